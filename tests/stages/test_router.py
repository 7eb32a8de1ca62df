"""The data-parallel router: prompts that share a long prefix go where it was sent, others to the
least loaded, and loads that drift apart override the cache (stages/router.py)."""

from __future__ import annotations

from stages.api import ChatPrompt, TextPrompt, TokensPrompt
from stages.router import Policy, PrefixIndex, ReplicaLoad, Router, routing_key

SYSTEM = "You are a careful assistant who answers questions about astronomy. " * 8  # 560 bytes


def idle(**changes) -> ReplicaLoad:
    values = {"ready": True, "in_flight": 0, "waiting": 0, "free_blocks": 100, "full": False}
    return ReplicaLoad(**{**values, **changes})


def router(policy: Policy = Policy.CACHE_AWARE, **changes) -> Router:
    values = {"chunk_bytes": 64, "capacity_chunks": 1000, "balance_abs_threshold": 4}
    return Router(2, policy, **{**values, **changes})


def chat(question: str, system: str = SYSTEM) -> ChatPrompt:
    return ChatPrompt(
        [{"role": "system", "content": system}, {"role": "user", "content": question}]
    )


def test_a_prompt_sharing_a_long_prefix_goes_where_the_prefix_went():
    r = router()
    first = r.route(r.key(chat("What is a pulsar?"), None), [idle(), idle()])
    assert first is not None and first.reason == "load" and first.matched_bytes == 0
    # the replica that served it is now busier, yet the prefix is worth more
    loads = [idle(), idle()]
    loads[first.replica] = idle(in_flight=1, free_blocks=60)
    second = r.route(r.key(chat("And a quasar?"), None), loads)
    assert second is not None
    assert (second.replica, second.reason) == (first.replica, "prefix")
    assert second.matched_bytes >= len(SYSTEM)


def test_prompts_with_nothing_in_common_go_to_the_least_loaded():
    r = router()
    r.route(r.key(chat("What is a pulsar?"), None), [idle(), idle()])
    bread = chat("Give me a recipe for bread.", system="You are a baker. " * 40)
    assert r.route(r.key(bread, None), [idle(in_flight=1), idle()]).replica == 1
    cake = chat("And one for cake.", system="You are a pastry chef. " * 40)
    assert r.route(r.key(cake, None), [idle(), idle(in_flight=1)]).replica == 0


def test_least_loaded_counts_waiting_first_then_in_flight_then_free_blocks():
    r = router()
    key = r.key(TextPrompt("short"), None)
    assert r.route(key, [idle(waiting=1), idle(in_flight=3)]).replica == 1
    assert r.route(key, [idle(in_flight=2), idle(in_flight=1)]).replica == 1
    assert r.route(key, [idle(free_blocks=90), idle(free_blocks=10)]).replica == 0


def test_imbalanced_loads_override_the_prefix():
    r = router(balance_abs_threshold=4)
    prompt = chat("What is a pulsar?")
    first = r.route(r.key(prompt, None), [idle(), idle()]).replica
    loads = [idle(), idle()]
    loads[first] = idle(in_flight=6)  # 6 - 0 > 4 and 6 > 0 * 1.5
    second = r.route(r.key(prompt, None), loads)
    assert (second.replica, second.reason) == (1 - first, "imbalanced")
    # now both hold it: the less loaded of the two takes the next
    loads = [idle(in_flight=2), idle(in_flight=2)]
    loads[first] = idle(in_flight=3)
    third = r.route(r.key(prompt, None), loads)
    assert (third.replica, third.reason) == (1 - first, "prefix")


def test_a_short_shared_part_does_not_outweigh_load():
    """Below the cache threshold (30% of the prompt) the saving is small: load decides."""
    r = router()
    long_question = "Explain, step by step, " + "why the sky is blue and sunsets are red. " * 40
    first = r.route(r.key(chat("What is a pulsar?"), None), [idle(), idle()]).replica
    loads = [idle(), idle()]
    loads[first] = idle(in_flight=1)
    second = r.route(r.key(chat(long_question), None), loads)
    assert (second.replica, second.reason) == (1 - first, "load")


def test_round_robin_alternates_whatever_the_prompt():
    r = router(Policy.ROUND_ROBIN)
    key = r.key(chat("What is a pulsar?"), None)
    assert [r.route(key, [idle(), idle()]).replica for _ in range(4)] == [0, 1, 0, 1]


def test_round_robin_keeps_no_prefix_index():
    """No index is read under round robin (nor without prefix caching): none grows with traffic,
    while the cache-aware router's holds what it sent."""
    for r in (router(Policy.ROUND_ROBIN), router(prefix_caching=False)):
        for i in range(20):
            route = r.route(r.key(chat(f"Question {i}?"), None), [idle(), idle()])
            assert route is not None and route.matched_bytes == 0
            assert route.key_bytes > len(SYSTEM)  # the log still says how long the prompt was
        assert [len(index) for index in r.indexes] == [0, 0]
    cache_aware = router()
    key = cache_aware.key(chat("What is a pulsar?"), None)
    cache_aware.route(key, [idle(), idle()])
    assert sum(len(index) for index in cache_aware.indexes) == len(key.chunk_hashes) > 0


def test_only_ready_replicas_and_those_with_room_are_chosen():
    r = router()
    key = r.key(chat("What is a pulsar?"), None)
    assert r.route(key, [idle(ready=False), idle(ready=False)]) is None
    assert r.route(key, [idle(ready=False), idle(in_flight=9)]).replica == 1
    # the prefix is on 1, but 1 is full: 0 takes it
    assert r.route(key, [idle(), idle(full=True)]).replica == 0
    both_full = r.route(key, [idle(full=True, in_flight=5), idle(full=True, in_flight=4)])
    assert (both_full.replica, both_full.reason) == (1, "all_full")


def test_without_prefix_caching_only_load_counts():
    r = router(prefix_caching=False)
    key = r.key(chat("What is a pulsar?"), None)
    r.route(key, [idle(), idle()])
    assert r.route(key, [idle(), idle(in_flight=1)]).reason == "load"
    assert r.route(key, [idle(in_flight=1), idle()]).replica == 1


def test_a_forgotten_replica_holds_nothing():
    r = router()
    key = r.key(chat("What is a pulsar?"), None)
    first = r.route(key, [idle(), idle()]).replica
    r.forget(first)
    loads = [idle(), idle()]
    loads[first] = idle(in_flight=1)
    assert r.route(key, loads).reason == "load"


def test_keys_share_chunks_exactly_as_far_as_the_prompts_agree():
    a = routing_key(TextPrompt("x" * 200 + "a" * 100), None, 64)
    b = routing_key(TextPrompt("x" * 200 + "b" * 100), None, 64)
    assert a.num_bytes == 300 and len(a.chunk_hashes) == 4  # the partial tail is no block
    assert a.chunk_hashes[:3] == b.chunk_hashes[:3] and a.chunk_hashes[3] != b.chunk_hashes[3]
    # the salt, the tools and BOS change every token, so they change every chunk
    salted = routing_key(TextPrompt("x" * 200), "tenant-a", 64)
    assert not set(salted.chunk_hashes) & set(a.chunk_hashes)
    no_bos = routing_key(TextPrompt("x" * 200, add_special_tokens=False), None, 64)
    assert not set(no_bos.chunk_hashes) & set(a.chunk_hashes)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    plain, with_tools = chat("q"), ChatPrompt(chat("q").messages, tools=tools)
    assert not set(routing_key(plain, None, 64).chunk_hashes) & set(
        routing_key(with_tools, None, 64).chunk_hashes
    )
    # token ids: a chunk of 64 bytes is 16 ids
    ids = routing_key(TokensPrompt(list(range(40))), None, 64)
    assert (ids.num_bytes, len(ids.chunk_hashes)) == (160, 2)


def test_the_index_forgets_tails_before_prefixes_and_keeps_its_capacity():
    index = PrefixIndex(capacity_chunks=6)
    old = routing_key(TextPrompt("p" * 256 + "old tail " * 30), None, 64)  # 8 chunks
    index.insert(old)
    assert len(index) == 6 and index.match(old) == 6  # its first 6 chunks stay
    new = routing_key(TextPrompt("q" * 256), None, 64)  # 4 chunks
    index.insert(new)
    assert len(index) == 6 and index.match(new) == 4 and index.match(old) == 2
