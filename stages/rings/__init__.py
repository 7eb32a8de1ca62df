"""The rings between the stages: per ring, its record layouts and one typed pack/unpack pair.

Rings (producer -> consumer), one message per engine step per ring, batched over requests:
  requests   server -> render     `submit` one request (msgpack of `GenerateRequest`), `abort`
  errors     render -> server     `error` a request render refused (status + OpenAI fields)
  prompts    render -> schedule   `prompt` a rendered request: token ids and what render resolved
  plan       schedule -> execute  `step` one engine step, with requests new to execute and the
                                  handles it may forget
  results    execute -> schedule  `result` the sampled tokens and logprobs of one step
  forward    execute rank 0 -> the other tensor-parallel ranks (a broadcast ring)
                                  `forward` one step's network inputs
  tokens     schedule -> detok    `tokens` new tokens and finishes per request, the detokenize
                                  parameters of requests seen for the first time
  stop_hits  detok -> schedule    `finished` handles a stop string finished
  deltas     detok -> server      `deltas` one step's text deltas, finishes, logprobs and metrics

An actor reads: receive, unpack, logic, pack, send. Nothing outside this package indexes a record.
"""
