"""The typed vocabulary between the stages: which records each ring carries. All batched per step.

Rings (producer -> consumer):
  requests   server -> render     `submit` one request (its fields msgpack-encoded: once per request,
                                  never per token), `abort` handles
  errors     render -> server     `error` a request the render stage refused (status + OpenAI fields)
  prompts    render -> schedule   `prompt` a rendered request: token ids, sampling row, stops;
                                  `abort` handles
  plan       schedule -> execute  `step` one engine step (a StepBatch, flattened), with the rows of
                                  requests new to execute and the handles it can forget
  results    execute -> schedule  `result` the sampled tokens and logprobs of one step
  tokens     schedule -> detok    `step` new tokens, finishes and stamps per request, plus the
                                  detokenize parameters of requests seen for the first time
  stop_hits  detok -> schedule    `finished` handles a stop string finished
  deltas     detok -> server      `deltas` one step's text deltas, finishes, logprobs and metrics
"""

from __future__ import annotations

import numpy as np

from pipeline.records import Record, Vocabulary

# -- requests: server -> render -------------------------------------------------------------------
SUBMIT = Record("submit", ("handle", np.int64), ("arrival_ns", np.int64), ("payload", np.uint8))
ABORT = Record("abort", ("handles", np.int64))
REQUESTS = Vocabulary("requests", [SUBMIT, ABORT])

# -- errors: render -> server ---------------------------------------------------------------------
ERROR = Record("error", ("handle", np.int64), ("status", np.int32), ("payload", np.uint8))
ERRORS = Vocabulary("errors", [ERROR])

# -- prompts: render -> schedule ------------------------------------------------------------------
# One row of per-request sampling parameters, as the sampler takes them.
SAMPLING_ROW = np.dtype(
    [
        ("temperature", np.float32),
        ("top_p", np.float32),
        ("top_k", np.int32),
        ("min_p", np.float32),
        ("presence_penalty", np.float32),
        ("frequency_penalty", np.float32),
        ("repetition_penalty", np.float32),
        ("seed", np.int64),
        ("min_tokens", np.int32),
        ("num_logprobs", np.int32),
        ("prompt_logprobs", np.int32),
    ]
)
# What the scheduler needs of a request, beside its tokens.
REQUEST_ROW = np.dtype(
    [
        ("handle", np.int64),
        ("priority", np.int32),
        ("max_tokens", np.int32),
        ("ignore_eos", np.bool_),
        ("arrival_ns", np.int64),
        ("render_start_ns", np.int64),
        ("rendered_ns", np.int64),
    ]
)
PROMPT = Record(
    "prompt",
    ("request", REQUEST_ROW),  # [1]
    ("sampling", SAMPLING_ROW),  # [1]
    ("prompt_ids", np.int32),
    ("stop_ids", np.int32),  # stop_token_ids, plus EOS unless ignore_eos
    ("bias_ids", np.int32),
    ("bias_values", np.float32),
    ("allowed_ids", np.int32),
    ("bad_words", np.int32),  # token sequences of the bad words, each followed by -1
    ("detok", np.uint8),  # msgpack of DetokParams, forwarded to detokenize untouched
    ("grammar", np.uint8),  # UTF-8 llguidance grammar (stages.structured); empty: unconstrained
)
PROMPTS = Vocabulary("prompts", [PROMPT, ABORT])

# -- plan: schedule -> execute --------------------------------------------------------------------
STEP_SEQ = np.dtype(
    [
        ("handle", np.int64),
        ("query_start", np.int32),
        ("query_len", np.int32),
        ("context_len", np.int32),  # KV length after this step
        ("prompt_len", np.int32),
        ("sample", np.bool_),
    ]
)
STEP = Record(
    "step",
    ("meta", np.int64),  # [step_id, num_seqs, block_table_width, scheduled_ns]
    ("seqs", STEP_SEQ),  # [B]
    ("input_ids", np.int32),  # [T]; -1: the token execute sampled at that position last step
    ("positions", np.int32),  # [T]
    ("slot_mapping", np.int64),  # [T]
    ("block_tables", np.int32),  # [B * width], padded with 0
    ("new_handles", np.int64),  # requests execute sees for the first time
    ("new_sampling", SAMPLING_ROW),
    ("new_id_offsets", np.int32),  # [N * 4 + 1]: stop, bias, allowed, bad-word id lists per new
    ("new_ids", np.int32),
    ("new_bias_values", np.float32),  # aligned with the bias id lists
    ("new_grammar_offsets", np.int32),  # [N + 1]: each new request's grammar in new_grammars
    ("new_grammars", np.uint8),  # UTF-8 llguidance grammars; empty: unconstrained
    ("free_handles", np.int64),  # requests execute may forget
)
PLAN = Vocabulary("plan", [STEP])

# -- results: execute -> schedule -----------------------------------------------------------------
# The logprob of one prompt token given the ones before it (requests that asked for
# prompt_logprobs); a prompt's rows arrive with the steps that prefill it, one chunk at a time.
PROMPT_LOGPROB_ROW = np.dtype(
    [
        ("handle", np.int64),
        ("position", np.int32),  # in the prompt; position 0 has no logprob (logprob nan, rank 0)
        ("token_id", np.int64),
        ("logprob", np.float32),
        ("rank", np.int64),
    ]
)
RESULT = Record(
    "result",
    ("meta", np.int64),  # [step_id, num_seqs, top_k, t_start_ns, t_end_ns, prompt_top_k]
    ("handles", np.int64),  # [B]
    ("token_ids", np.int64),  # [B], -1 where not sampled
    ("logprobs", np.float32),  # [B]
    ("ranks", np.int64),  # [B]
    ("top_ids", np.int64),  # [B * top_k]
    ("top_logprobs", np.float32),  # [B * top_k]
    ("prompt_rows", PROMPT_LOGPROB_ROW),  # [P]
    ("prompt_top_ids", np.int64),  # [P * prompt_top_k], -1 padded
    ("prompt_top_logprobs", np.float32),  # [P * prompt_top_k]
)
RESULTS = Vocabulary("results", [RESULT])

# -- tokens: schedule -> detokenize ---------------------------------------------------------------
FINISH_NONE, FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = 0, 1, 2, 3
FINISH_NAMES = {FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_ABORT: "abort"}
TOKEN_ROW = np.dtype(
    [
        ("handle", np.int64),
        ("token_id", np.int64),  # -1: no new token (an abort)
        ("logprob", np.float32),
        ("rank", np.int64),
        ("finish", np.int8),
        ("stop_token", np.bool_),  # the finish was a stop token id (not EOS): say which
        ("num_prompt_tokens", np.int32),
        ("num_output_tokens", np.int32),
        ("num_preemptions", np.int32),
        ("num_cached_tokens", np.int32),  # prompt tokens found in the prefix cache
    ]
)
STAMP_ROW = np.dtype(
    [
        ("arrival_ns", np.int64),
        ("render_start_ns", np.int64),
        ("rendered_ns", np.int64),
        ("scheduled_ns", np.int64),
        ("first_token_ns", np.int64),
        ("last_token_ns", np.int64),
        ("prefill_done_ns", np.int64),
    ]
)
TOKENS = Record(
    "tokens",
    ("meta", np.int64),  # [step_id, top_k, prompt_top_k]
    ("rows", TOKEN_ROW),  # [B]
    ("stamps", STAMP_ROW),  # [B]
    ("top_ids", np.int64),  # [B * top_k]
    ("top_logprobs", np.float32),
    ("new_handles", np.int64),  # requests detokenize sees for the first time
    ("new_offsets", np.int32),  # [N + 1] into new_detok
    ("new_detok", np.uint8),  # msgpack DetokParams, concatenated
    ("prompt_rows", PROMPT_LOGPROB_ROW),  # prompt logprobs of this step's prefill chunks
    ("prompt_top_ids", np.int64),
    ("prompt_top_logprobs", np.float32),
)
TOKENS_VOCAB = Vocabulary("tokens", [TOKENS])

# -- stop_hits: detokenize -> schedule ------------------------------------------------------------
FINISHED = Record("finished", ("handles", np.int64))
STOP_HITS = Vocabulary("stop_hits", [FINISHED])

# -- deltas: detokenize -> server -----------------------------------------------------------------
DELTA_ROW = np.dtype(
    [
        ("handle", np.int64),
        ("finish", np.int8),
        ("num_prompt_tokens", np.int32),
        ("num_output_tokens", np.int32),
        ("token_id", np.int64),  # the new token, -1 if none
    ]
)
DELTAS = Record(
    "deltas",
    ("rows", DELTA_ROW),  # [n]
    ("text_offsets", np.int32),  # [n + 1] into text (UTF-8)
    ("text", np.uint8),
    (
        "extra_offsets",
        np.int32,
    ),  # [n + 1] into extra: msgpack of token ids, logprobs, metrics, stop
    ("extra", np.uint8),
)
DELTAS_VOCAB = Vocabulary("deltas", [DELTAS])

# -- trace span kinds (pipeline/trace.py): what each stage records per unit of work ----------------
SPAN_RENDER, SPAN_PLAN, SPAN_RESULT, SPAN_FORWARD, SPAN_DETOKENIZE = 1, 2, 3, 4, 5
SPAN_NAMES = {
    SPAN_RENDER: "render",
    SPAN_PLAN: "plan",
    SPAN_RESULT: "result",
    SPAN_FORWARD: "forward",
    SPAN_DETOKENIZE: "detokenize",
}
