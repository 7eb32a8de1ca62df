"""The CPU kernels of `cpu_ops.c`, built at first use for one ISA level and called through ctypes.

Torch runs a decode layer on CPU as ~60 small eager ops and gathers every sequence's KV blocks per
layer; these kernels do norms, RoPE with the KV write, paged attention and the quantized thin
matmuls in one pass each. The library is compiled with the system C compiler for the level
gpu/cpu_isa.py chooses (PIPELINE_SERVE_CPU_ISA; explicit `-march` targets, tuned for this CPU)
into a cache keyed by the source, the flags, the compiler and the CPU, so a process pays the build
(a few seconds) once per machine and level. A failed build is remembered there too, not retried
by every process. PIPELINE_SERVE_NATIVE=0 asks for the torch path; without a compiler the torch
path is used with a warning; a compiler that fails on the source is an error (KernelBuildError).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import structlog
import torch

from gpu.cpu_isa import ISA_ENV, chosen_level, cpuinfo_lines, target_flags

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.c")
NATIVE_ENV = "PIPELINE_SERVE_NATIVE"
FLAGS = ("-O3", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c11")

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES: dict[str, tuple[object, ...]] = {
    "rms_norm_f32": (_ptr, _ptr, _ptr, _i64, _i64, _f32),
    "add_rms_norm_f32": (_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32),
    "silu_mul_f32": (_ptr, _ptr, _i64, _i64),
    "rope_write_kv": (_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, ctypes.c_int),
    "paged_decode_attention": (
        *(_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, ctypes.c_int),
        *(_i64, _i64, _i64, _i64, _f32, _i64, _ptr, _i64),
    ),
    "q4_1_pack": (_ptr, _ptr, _i64, _i64),
    "q4_1_matmul": (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr),
    "q8_0_matmul": (_ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr),
    "q4_decode_layer": (_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_int, _ptr, _ptr),
    "q4_layer_attn_in": (_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_int, _ptr),
    "q4_layer_attn_out": (_ptr, _ptr, _ptr, _ptr, _ptr),
    "q4_1_gemm_pack": (_ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr),
    "q4_1_gemm": (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr),
    "q4_1_gemm_available": (),
    "attend_vectors": (),
    "q8_0_gemm_pack": (_ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr),
    "q8_0_gemm": (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr),
    "paged_prefill_attention": (
        *(_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, ctypes.c_int),
        *(_i64, _i64, _i64, _i64, _f32, _i64, _ptr, _i64),
    ),
    "stream_read": (_ptr, _i64),
    "int8_peak_macs": (_i64,),
    "bind_threads": (_ptr, _i64),
}
_RETURNS = {
    "stream_read": ctypes.c_uint64,
    "int8_peak_macs": ctypes.c_double,
    "bind_threads": ctypes.c_int,
}
_RETURNS_STATUS = (
    *("q4_1_matmul", "q8_0_matmul", "q4_1_gemm", "q8_0_gemm", "paged_decode_attention"),
    *("q4_decode_layer", "q4_layer_attn_in", "q4_layer_attn_out", "paged_prefill_attention"),
)


class KernelBuildError(RuntimeError):
    """A C compiler exists and failed on cpu_ops.c: serving on the torch path instead would be a
    silent several-fold slowdown, so it is an error unless the torch path is asked for."""


def cache_dir() -> Path:
    root = os.environ.get("PIPELINE_SERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pipeline-serve"
    )
    return Path(root) / "native"


def _cpu_identity() -> str:
    """What a build tuned for this CPU depends on: its model and feature flags."""
    return "".join(sorted(set(cpuinfo_lines()))) or platform.processor()


def _build(compiler: str, level: str) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    flags = (*FLAGS, *target_flags(level))
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(flags), version, _cpu_identity()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"cpu_ops-{level}-{key}.so"
    failed = target.with_suffix(".failed")
    if target.exists():
        return target
    if failed.exists():
        raise KernelBuildError(_build_failure(level, compiler, failed.read_text(), failed))
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("building CPU kernels", isa=level, compiler=compiler, target=str(target))
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        built = subprocess.run(
            [compiler, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True
        )
        if built.returncode != 0:
            message = (built.stderr or built.stdout)[-4000:]
            failed.write_text(message, encoding="utf-8")  # every later process reads it
            raise KernelBuildError(_build_failure(level, compiler, message, failed))
        os.replace(tmp, target)  # atomic: concurrent builders all end with a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _build_failure(level: str, compiler: str, message: str, marker: Path) -> str:
    return (
        f"the CPU kernels ({SOURCE.name}, {level}) failed to build with {compiler}:\n"
        f"{message.strip()}\n"
        f"Fix the build (remove {marker} to try again), choose another level with {ISA_ENV}, "
        f"or serve on the several-fold slower torch path with {NATIVE_ENV}=0."
    )


@cache
def load() -> ctypes.CDLL | None:
    """The kernel library of the chosen level, or None for the torch path: asked for with
    PIPELINE_SERVE_NATIVE=0, or where there is no C compiler (with a warning). A compiler that
    fails raises KernelBuildError; a level the CPU does not run raises ValueError."""
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return None
    level = chosen_level()
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None or platform.system() != "Linux":
        log.warning(
            "no C compiler: the CPU kernels are off and the torch path, several times slower, "
            "serves; install gcc to build them",
            isa=level,
        )
        return None
    path = _build(compiler, level)
    library = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        returns_int = (
            name in _RETURNS_STATUS or name.endswith("_available") or name == "attend_vectors"
        )
        function.restype = _RETURNS.get(name, ctypes.c_int if returns_int else None)
    log.info("CPU kernels loaded", isa=level, library=str(path))
    return library


def kernel_set() -> str:
    """What runs a CPU model: the level of the loaded kernels, or `torch`."""
    return "torch" if load() is None else chosen_level()


def reset() -> None:
    """Forget the loaded library, so that the next call reads the environment again."""
    load.cache_clear()
    gemm_available.cache_clear()
    max_group.cache_clear()


@cache
def max_group() -> int:
    """Query heads per KV head the attention kernels hold (cpu_ops.c's ATTEND_VECTORS)."""
    return int(_lib().attend_vectors())


@contextmanager
def using_level(level: str) -> Iterator[str]:
    """The kernels of `level` loaded for the block, and the level before it after: how the
    tests and `pipeline-bench model --cpu-isa` run several levels in one process. A model keeps
    the weight layout of the level it was built under, so build it inside."""
    before = os.environ.get(ISA_ENV)
    os.environ[ISA_ENV] = level
    reset()
    try:
        yield chosen_level()
    finally:
        if before is None:
            os.environ.pop(ISA_ENV, None)
        else:
            os.environ[ISA_ENV] = before
        reset()


def available() -> bool:
    return load() is not None


def _lib() -> ctypes.CDLL:
    library = load()
    if library is None:
        raise RuntimeError("the native CPU kernels are not available")
    return library


def _check(t: torch.Tensor, dtype: torch.dtype, name: str) -> int:
    if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name}: need a contiguous CPU {dtype} tensor, got {t.dtype} {t.device}")
    return t.data_ptr()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] float32 -> rms_norm(x) * weight."""
    out = torch.empty_like(x)
    rows, dim = x.shape
    _lib().rms_norm_f32(
        _check(x, torch.float32, "x"),
        _check(weight, torch.float32, "weight"),
        out.data_ptr(),
        rows,
        dim,
        eps,
    )
    return out


def add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x (in place); returns rms_norm(residual) * weight."""
    out = torch.empty_like(x)
    rows, dim = x.shape
    _lib().add_rms_norm_f32(
        _check(residual, torch.float32, "residual"),
        _check(x, torch.float32, "x"),
        _check(weight, torch.float32, "weight"),
        out.data_ptr(),
        rows,
        dim,
        eps,
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * I] float32 -> silu(gate) * up, [T, I]."""
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=torch.float32)
    _lib().silu_mul_f32(_check(gate_up, torch.float32, "gate_up"), out.data_ptr(), rows, width // 2)
    return out


def rope_write_kv(
    qkv: torch.Tensor,  # [T, (H + 2 * KVH) * D] float32, q and k rotated in place
    cos: torch.Tensor,  # [T, D / 2] float32
    sin: torch.Tensor,  # [T, D / 2] float32
    num_heads: int,
    num_kv_heads: int,
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = do not store
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] float32 or bfloat16
    v_cache: torch.Tensor,
) -> None:
    head_dim = cos.shape[1] * 2
    if k_cache.dtype != v_cache.dtype or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError("rope_write_kv: qkv width or cache dtypes do not fit")
    cache_dtype = k_cache.dtype
    _lib().rope_write_kv(
        _check(qkv, torch.float32, "qkv"),
        qkv.shape[0],
        _check(cos, torch.float32, "cos"),
        _check(sin, torch.float32, "sin"),
        num_heads,
        num_kv_heads,
        head_dim,
        _check(slot_mapping, torch.int64, "slot_mapping"),
        _check(k_cache, cache_dtype, "k_cache"),
        _check(v_cache, cache_dtype, "v_cache"),
        int(cache_dtype == torch.bfloat16),
    )


def paged_decode_attention(
    q: torch.Tensor,  # [T, H, D] float32, rows may be strided; rows token_index are decodes
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] float32 or bfloat16
    v_cache: torch.Tensor,
    token_index: torch.Tensor,  # [S] int64: the row of q each decoding sequence owns
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    context_lens: torch.Tensor,  # [S] int32
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,  # [T, H, D] float32; rows token_index are written
) -> None:
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads // num_kv_heads > max_group():
        raise ValueError(f"paged_decode_attention: more than {max_group()} query heads per KV head")
    if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != head_dim:
        raise ValueError("paged_decode_attention: q must be float32 rows of contiguous heads")
    cache_dtype = k_cache.dtype
    status = _lib().paged_decode_attention(
        q.data_ptr(),
        q.stride(0),
        _check(token_index, torch.int64, "token_index"),
        token_index.shape[0],
        _check(block_tables, torch.int32, "block_tables"),
        block_tables.shape[1],
        _check(context_lens, torch.int32, "context_lens"),
        _check(k_cache, cache_dtype, "k_cache"),
        _check(v_cache, cache_dtype, "v_cache"),
        int(cache_dtype == torch.bfloat16),
        block_size,
        num_heads,
        num_kv_heads,
        head_dim,
        scale,
        sliding_window or 0,
        _check(out, torch.float32, "out"),
        num_heads * head_dim,
    )
    if status:
        raise MemoryError("paged_decode_attention: no memory for the work items")


def q4_1_pack(nibbles: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1 nibbles [N, K / 32, 16] (weight i low, i + 16 high) -> the kernel's layout,
    same shape and size: several blocks' codes per load (see q4_1_pack in cpu_ops.c)."""
    packed = torch.empty_like(nibbles)
    rows, blocks, _ = nibbles.shape
    _lib().q4_1_pack(_check(nibbles, torch.uint8, "nibbles"), packed.data_ptr(), rows, blocks)
    return packed


def _matmul(
    name: str,
    x: torch.Tensor,  # [M, K] float32
    weight_k: int,  # the K the weights were packed for
    n_out: int,
    *weights: tuple[torch.Tensor, torch.dtype],  # the kernel's weight arrays, in its order
    out: torch.Tensor | None = None,  # [M, N] float32 contiguous; None: a new one
) -> torch.Tensor:  # [M, N] float32 = x @ W.T, x quantized per 32 to int8 on the way
    rows, k = x.shape
    if weight_k != k or k % 32:
        raise ValueError(f"{name}: x {tuple(x.shape)} does not fit weights of {weight_k} inputs")
    if out is None:
        out = torch.empty(rows, n_out, dtype=torch.float32)
    elif out.shape != (rows, n_out):
        raise ValueError(f"{name}: out {tuple(out.shape)} is not [{rows}, {n_out}]")
    _check(out, torch.float32, "out")
    arrays = [_check(t, dtype, name) for t, dtype in weights]
    status = getattr(_lib(), name)(
        _check(x, torch.float32, "x"), rows, *arrays, n_out, k, out.data_ptr()
    )
    if status:
        raise MemoryError(f"{name}: no memory for the quantized activations")
    return out


def q4_1_matmul(
    x: torch.Tensor,  # [M, K] float32
    qs: torch.Tensor,  # [N, K / 32, 16] uint8: GGUF Q4_1 nibbles put through q4_1_pack
    d: torch.Tensor,  # [N, K / 32] float16 scales
    m: torch.Tensor,  # [N, K / 32] float16 minimums
) -> torch.Tensor:  # [M, N] float32
    return _matmul(
        "q4_1_matmul",
        x,
        qs.shape[1] * 32,
        qs.shape[0],
        (qs, torch.uint8),
        (d, torch.float16),
        (m, torch.float16),
    )


def q8_0_matmul(
    x: torch.Tensor,  # [M, K] float32
    wq: torch.Tensor,  # [N, K] int8: GGUF Q8_0 values
    wd: torch.Tensor,  # [N, K / 32] float32 scales
) -> torch.Tensor:  # [M, N] float32
    return _matmul(
        "q8_0_matmul", x, wq.shape[1], wq.shape[0], (wq, torch.int8), (wd, torch.float32)
    )


class Q4Layer(ctypes.Structure):
    """cpu_ops.c's q4_layer: one decoder layer's dimensions and weight pointers."""

    _fields_ = [
        *[(name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter")],
        *[(name, ctypes.c_float) for name in ("eps_attn", "eps_mlp", "scale")],
        ("sliding_window", ctypes.c_int64),
        *[
            (name, ctypes.c_void_p)
            for name in (
                *("norm_attn", "norm_mlp", "qkv_q", "qkv_d", "qkv_m", "qkv_bias"),
                *("o_q", "o_d", "o_m", "gate_up_q", "gate_up_d", "gate_up_m"),
                *("down_q", "down_d", "down_m"),
                *("qkv_la", "qkv_lb", "o_la", "o_lb", "gate_up_la", "gate_up_lb"),
                *("down_la", "down_lb"),
            )
        ],
        *[(name, ctypes.c_int64) for name in ("qkv_lw", "o_lw", "gate_up_lw", "down_lw")],
    ]


# cpu_ops.c's LORA_MAX_WIDTH, the widest adapter slot (parts times --max-lora-rank) the layer
# calls take (the shrunk rows stay on the stack), and LORA_TILE, the most rows of one slot a
# pass over its weights serves.
LORA_MAX_WIDTH = 2048
LORA_TILE = 4


class DecodeStep(ctypes.Structure):
    """cpu_ops.c's decode_step: a step's rows, their RoPE angles and KV slots, its decode rows'
    block tables, and its adapter rows."""

    _fields_ = [
        ("tokens", ctypes.c_int64),
        *[
            (name, ctypes.c_void_p)
            for name in ("cos", "sin", "slot_mapping", "token_index", "block_tables")
        ],
        ("table_stride", ctypes.c_int64),
        ("context_lens", ctypes.c_void_p),
        ("block_size", ctypes.c_int64),
        ("cache_bf16", ctypes.c_int),
        ("lora_n_tiles", ctypes.c_int64),
        ("lora_tiles", ctypes.c_void_p),
        ("lora_rows", ctypes.c_void_p),
        ("lora_slots", ctypes.c_void_p),
    ]


def q4_decode_layer(
    layer: Q4Layer,
    step: DecodeStep,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    x: torch.Tensor,  # [T, hidden] float32: this layer's input, replaced by its output
    residual: torch.Tensor,  # [T, hidden] float32: the residual stream, updated
    first: bool,  # layer 0: x is the embeddings and residual is set from it
    qkv: torch.Tensor,  # [T, (H + 2 KVH) * D] float32 scratch
    attn: torch.Tensor,  # [T, H * D] float32 scratch
) -> None:
    """A whole layer for a step of decodes only."""
    status = _lib().q4_decode_layer(
        ctypes.byref(layer),
        ctypes.byref(step),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        x.data_ptr(),
        residual.data_ptr(),
        int(first),
        qkv.data_ptr(),
        attn.data_ptr(),
    )
    if status:
        raise MemoryError("q4_decode_layer: no memory for the layer's scratch")


def q4_layer_attn_in(
    layer: Q4Layer,
    step: DecodeStep,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor,
    first: bool,
    qkv: torch.Tensor,  # receives the rotated q, k and v rows
) -> None:
    """The layer up to attention (norm, qkv, RoPE, KV write) for any step."""
    status = _lib().q4_layer_attn_in(
        ctypes.byref(layer),
        ctypes.byref(step),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        x.data_ptr(),
        residual.data_ptr(),
        int(first),
        qkv.data_ptr(),
    )
    if status:
        raise MemoryError("q4_layer_attn_in: no memory for the layer's scratch")


def q4_layer_attn_out(
    layer: Q4Layer,
    step: DecodeStep,
    attn: torch.Tensor,  # [T, H * D] float32, T = step.tokens
    x: torch.Tensor,
    residual: torch.Tensor,
) -> None:
    """The layer after attention (o, norm, gate_up, SwiGLU, down); x receives its output."""
    status = _lib().q4_layer_attn_out(
        ctypes.byref(layer),
        ctypes.byref(step),
        attn.data_ptr(),
        x.data_ptr(),
        residual.data_ptr(),
    )
    if status:
        raise MemoryError("q4_layer_attn_out: no memory for the layer's scratch")


def stream_read_bytes_per_s(tensors: list[torch.Tensor], passes: int = 5) -> float:
    """The rate this build's threads read the tensors' bytes (a decode step's packed weights),
    best of `passes` passes over all of them, as STREAM's read test: the bound of a GEMV."""
    buffers = [t for t in tensors if t.is_contiguous() and t.numel() * t.element_size() >= 8]
    total = sum(t.numel() * t.element_size() // 8 * 8 for t in buffers)
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for t in buffers:
            _lib().stream_read(t.data_ptr(), t.numel() * t.element_size() // 8)
        best = min(best, time.perf_counter() - start)
    return total / best if best > 0 else 0.0


def bind_threads(cpus: Sequence[int]) -> int:
    """Each thread of the OpenMP pool (the kernels' and torch's) onto one of `cpus`, thread t
    onto cpus[t % len]: how many were bound (0 where the OS has no per-thread affinity)."""
    cores = (ctypes.c_int32 * len(cpus))(*cpus)
    bound = int(_lib().bind_threads(ctypes.addressof(cores), len(cpus)))
    if bound < 0:
        raise OSError(f"bind_threads: the OS refused to bind a thread to one of {list(cpus)}")
    return bound


def int8_peak_macs_per_s(iterations: int = 2_000_000) -> float:
    """int8 multiply-adds per second of this build's GEMM instruction on all its threads, every
    operand in registers (vpdpbusd zmm on avx512_vnni, vpmaddubsw ymm below it): the bound of the
    many-row kernels. 0 in the portable build."""
    _lib().int8_peak_macs(iterations // 10)  # the clock ramps up
    return float(_lib().int8_peak_macs(iterations))


@cache
def gemm_available() -> bool:
    """Whether this build has the many-row Q4_1/Q8_0 kernels and their 16-channel layout (every
    level from avx2 up; the portable build keeps the row layout)."""
    return load() is not None and bool(_lib().q4_1_gemm_available())


def q4_1_gemm_pack(
    nibbles: torch.Tensor,  # [N, K / 32, 16] uint8, GGUF layout
    d: torch.Tensor,  # [N, K / 32] float16
    m: torch.Tensor,  # [N, K / 32] float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The many-row kernel's layout: 16 output channels per vector (see cpu_ops.c)."""
    n_out, blocks, _ = nibbles.shape
    groups = -(-n_out // 16)
    codes = torch.empty(groups, blocks, 4, 64, dtype=torch.uint8)
    d_out = torch.empty(groups, blocks, 16, dtype=torch.float16)
    m_out = torch.empty(groups, blocks, 16, dtype=torch.float16)
    _lib().q4_1_gemm_pack(
        _check(nibbles, torch.uint8, "nibbles"),
        _check(d, torch.float16, "d"),
        _check(m, torch.float16, "m"),
        n_out,
        blocks,
        codes.data_ptr(),
        d_out.data_ptr(),
        m_out.data_ptr(),
    )
    return codes, d_out, m_out


def q4_1_gemm(
    x: torch.Tensor,  # [M, K] float32
    codes: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor,  # from q4_1_gemm_pack
    n_out: int,
    out: torch.Tensor | None = None,  # [M, N] float32 to write into; None: a new one
) -> torch.Tensor:  # [M, N] float32
    return _matmul(
        "q4_1_gemm",
        x,
        codes.shape[1] * 32,
        n_out,
        (codes, torch.uint8),
        (d, torch.float16),
        (m, torch.float16),
        out=out,
    )


def q8_0_gemm_pack(
    codes: torch.Tensor,  # [N, K] int8, GGUF Q8_0 values
    d: torch.Tensor,  # [N, K / 32] float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The many-row kernel's layout: 16 output channels per vector (see cpu_ops.c)."""
    n_out, k = codes.shape
    groups, blocks = -(-n_out // 16), k // 32
    packed = torch.empty(groups, blocks, 8, 64, dtype=torch.int8)
    d_out = torch.empty(groups, blocks, 16, dtype=torch.float16)
    corr = torch.empty(groups, blocks, 16, dtype=torch.int32)
    _lib().q8_0_gemm_pack(
        _check(codes, torch.int8, "codes"),
        _check(d, torch.float16, "d"),
        n_out,
        blocks,
        packed.data_ptr(),
        d_out.data_ptr(),
        corr.data_ptr(),
    )
    return packed, d_out, corr


def q8_0_gemm(
    x: torch.Tensor,  # [M, K] float32
    codes: torch.Tensor,
    d: torch.Tensor,
    corr: torch.Tensor,  # from q8_0_gemm_pack
    n_out: int,
    out: torch.Tensor | None = None,  # [M, N] float32 to write into; None: a new one
) -> torch.Tensor:  # [M, N] float32
    return _matmul(
        "q8_0_gemm",
        x,
        codes.shape[1] * 32,
        n_out,
        (codes, torch.int8),
        (d, torch.float16),
        (corr, torch.int32),
        out=out,
    )


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D] float32, rows may be strided; rows start:end are the chunk
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] float32 or bfloat16
    v_cache: torch.Tensor,
    start: int,
    end: int,
    context_len: int,  # the sequence's KV length after this step; the chunk is its last tokens
    block_table: torch.Tensor,  # [max_blocks] int32, contiguous
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,  # [T, H, D] float32 contiguous; rows start:end are written
) -> None:
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads // num_kv_heads > max_group():
        raise ValueError(
            f"paged_prefill_attention: more than {max_group()} query heads per KV head"
        )
    if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != head_dim:
        raise ValueError("paged_prefill_attention: q must be float32 rows of contiguous heads")
    cache_dtype = k_cache.dtype
    _check(out, torch.float32, "out")
    status = _lib().paged_prefill_attention(
        q.data_ptr() + start * q.stride(0) * 4,
        q.stride(0),
        end - start,
        context_len,
        _check(block_table, torch.int32, "block_table"),
        _check(k_cache, cache_dtype, "k_cache"),
        _check(v_cache, cache_dtype, "v_cache"),
        int(cache_dtype == torch.bfloat16),
        block_size,
        num_heads,
        num_kv_heads,
        head_dim,
        scale,
        sliding_window or 0,
        out.data_ptr() + start * out.stride(0) * 4,
        out.stride(0),
    )
    if status:
        raise MemoryError("paged_prefill_attention: no memory for the work items")
