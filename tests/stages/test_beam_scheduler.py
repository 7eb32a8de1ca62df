"""Beam search in the scheduler: a request's beams are planned together, share their prompt's and
common prefix's KV blocks (copy on write of a shared, partly filled block), and give every block
back when they are dropped, when the search ends and when the request is aborted."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from stages.api import BeamSearchParams
from stages.beam_group import BeamGroup, BeamRequest
from stages.rings import common as m
from stages.scheduler import Scheduler, SchedulerConfig, Sequence, Status

EOS = 0
BLOCK = 4


def make(num_blocks: int = 64, budget: int = 32) -> Scheduler:
    return Scheduler(SchedulerConfig(8, budget, 512, num_blocks, BLOCK))


def choices(width: int, prompt_len: int = 6, max_tokens: int = 20, stop=()) -> list[Sequence]:
    prompt = np.arange(1, prompt_len + 1, dtype=np.int32) + 100
    return [
        Sequence(
            handle=10 + index,
            priority=0,
            arrival_ns=index,
            prompt_ids=prompt,
            max_tokens=max_tokens,
            stop_ids=frozenset({EOS}),
            rendered=b"",
            detok=b"",
            beam_request=BeamRequest(BeamSearchParams(width, group=7, index=index), stop),
        )
        for index in range(width)
    ]


def single(handle: int) -> Sequence:
    """A request without beams."""
    return Sequence(
        handle=handle,
        priority=0,
        arrival_ns=100 + handle,
        prompt_ids=np.arange(3, dtype=np.int32) + 50 * handle,
        max_tokens=5,
        stop_ids=frozenset(),
        rendered=b"",
        detok=b"",
    )


def step(s: Scheduler, candidates):
    """Plan a step and complete it; `candidates(row)` gives a row's (ids, logprobs)."""
    planned = s.schedule()
    assert planned is not None
    rows = [candidates(i, x) for i, x in enumerate(planned.seqs)]
    k = max(len(ids) for ids, _ in rows)
    top_ids = np.full((len(rows), k), -1, np.int64)
    top_lps = np.full((len(rows), k), -np.inf, np.float32)
    for i, (ids, lps) in enumerate(rows):
        top_ids[i, : len(ids)], top_lps[i, : len(lps)] = ids, lps
    handles = np.array([x.seq.handle for x in planned.seqs])
    tokens = top_ids[:, 0].copy()
    emitted, _ = s.complete(planned.step_id, handles, tokens, None, 0, 0, top_ids, top_lps)
    return planned, emitted


def spread(i, x):
    """Each beam's best tokens: distinct per row, so the beams diverge."""
    ids = np.arange(1, 9) + 10 * i
    return ids, np.log(np.linspace(0.3, 0.01, 8)).astype(np.float32)


def test_the_search_waits_for_every_choice_and_the_leader_prefills_alone():
    s = make()
    first, *rest = choices(3)
    s.add(rest[0])
    s.add(first)
    assert s.schedule() is None  # one choice still to come
    s.add(rest[1])
    planned, emitted = step(s, spread)
    assert [(x.seq.handle, x.num_tokens) for x in planned.seqs] == [(10, 6)]
    assert emitted == []  # nothing until the search ends
    assert all(c.status == Status.PARKED for c in rest)


def test_beams_share_the_prompt_blocks_and_copy_the_partly_filled_one():
    s = make()
    for c in choices(3, prompt_len=6):  # blocks of 4: one full, one holding 2 tokens
        s.add(c)
    step(s, spread)  # the prompt's candidates: three beams from it
    leader = s.by_handle[10]
    beams = leader.beam.beams
    assert len(beams) == 3
    assert leader.blocks == []  # its prompt blocks now belong to the beams
    full = beams[0].blocks[0]
    assert all(b.blocks[0] == full for b in beams)  # the full prompt block: one copy
    used = s.blocks.num_blocks - s.blocks.num_free
    assert used == 2
    planned = s.schedule()
    assert planned is not None
    assert [x.seq.beam_of for x in planned.seqs] == [leader] * 3  # planned together
    # Each beam writes position 6, in the shared partial block: all but the last to write it get
    # a copy of it first.
    assert len(planned.block_copies) == 2
    sources = {src for src, _ in planned.block_copies}
    assert len(sources) == 1
    lasts = [b.blocks[1] for b in beams]
    assert len(set(lasts)) == 3
    assert s.blocks.num_blocks - s.blocks.num_free == 4


def test_a_search_is_not_planned_again_before_its_candidates_are_back():
    s = make()
    for c in choices(2):
        s.add(c)
    step(s, spread)
    assert s.schedule() is not None
    assert s.schedule() is None  # its beams' step is in flight


def test_dropped_beams_give_their_blocks_back_and_the_end_frees_everything():
    s = make()
    for c in choices(2, prompt_len=4, max_tokens=6):
        s.add(c)
    free_before = s.blocks.num_free
    emitted = []
    while not emitted:
        _, emitted = step(s, spread)
        # at most the prompt's block and two per beam: dropped beams gave theirs back
        assert s.blocks.num_blocks - s.blocks.num_free <= 1 + 2 * 2
    assert {seq.handle for seq, _ in emitted} == {10, 11}
    assert all(len([t for seq, t in emitted if seq.handle == h]) == 6 for h in (10, 11))
    assert s.blocks.num_free == free_before
    assert not s.running and not s.beam_groups
    assert all(seq.finish == m.FINISH_LENGTH for seq, _ in emitted)


def test_hypotheses_go_to_the_choices_best_first():
    s = make()
    for c in choices(2, max_tokens=8):
        s.add(c)

    def ending(i, x):
        # the best candidate is EOS for every beam: hypotheses end at once
        return np.array([EOS, 5, 6, 7]), np.log(np.array([0.7, 0.2, 0.05, 0.05])).astype(np.float32)

    _, emitted = step(s, ending)
    assert emitted == []  # one hypothesis found; the other is still to be found
    _, emitted = step(s, ending)
    by_handle: dict[int, list[int]] = {}
    for seq, token in emitted:
        by_handle.setdefault(seq.handle, []).append(token)
    assert by_handle[10] == [EOS]  # log 0.7 / 1 is the best score
    assert by_handle[11] == [5, EOS]
    assert [seq.finish for seq, _ in emitted if seq.handle == 10] == [m.FINISH_STOP]
    assert s.blocks.num_free == s.blocks.num_blocks


def test_an_abort_frees_the_beams_even_with_their_step_in_flight():
    s = make()
    for c in choices(3):
        s.add(c)
    step(s, spread)
    planned = s.schedule()
    assert planned is not None
    for handle in (10, 11, 12):
        s.abort(handle)
    assert s.blocks.num_free == s.blocks.num_blocks
    ids = np.ones((3, 8), np.int64)
    s.complete(planned.step_id, np.array([10] * 3), ids[:, 0], None, 0, 0, ids, ids * 0.0)
    assert not s.by_handle and not s.beam_groups and s.schedule() is None


def test_a_preempted_search_starts_over_from_its_prompt():
    s = make(num_blocks=3)
    for c in choices(2, prompt_len=6, max_tokens=40):
        s.add(c)
    step(s, spread)
    step(s, spread)  # positions 6 and 7: the partly filled prompt block, copied for one beam
    step(s, spread)
    leader = s.by_handle[10]
    # Both beams now descend from one: position 8 needs a block for each, and one is free. The
    # search (alone) is preempted, and readmitted at once from its prompt.
    planned, _ = step(s, spread)
    # (its prompt's full block is still in the prefix cache: the rest is computed again)
    assert [(x.seq.handle, x.start, x.seq.beam_of) for x in planned.seqs] == [(10, 4, None)]
    assert s.num_preemptions == 1 and leader.num_preemptions == 1
    assert [b.output_ids for b in leader.beam.beams] == [[1], [2]]  # the first step's again
    assert s.blocks.num_free == 1


def test_a_choice_resubmitted_after_a_failure_gets_only_what_its_client_lacks():
    s = make()
    members = choices(2, max_tokens=3)
    members[1].output_ids = [11, 12]  # its client read these before the stage failed
    for c in members:
        s.add(c)
    planned, _ = step(s, spread)
    assert planned.seqs[0].num_tokens == 6  # the prompt alone: the search starts over
    emitted: list = []
    while not emitted:
        _, emitted = step(s, spread)
    full = [t for seq, t in emitted if seq.handle == 10]
    rest = [t for seq, t in emitted if seq.handle == 11]
    assert len(full) == 3 and len(rest) == 1
    assert s.by_handle == {}


def test_a_search_counts_its_beams_against_max_num_seqs():
    s = Scheduler(SchedulerConfig(4, 64, 512, 64, BLOCK))
    for c in choices(3):
        s.add(c)
    step(s, spread)
    plain, late = single(1), single(2)
    s.add(plain)
    s.add(late)
    planned = s.schedule()
    assert planned is not None
    # three beams and one request fill the four rows: the second request waits
    assert sorted({x.seq.handle for x in planned.seqs}) == [1, 10]
    assert late.status == Status.WAITING


def test_a_stop_string_ends_a_beam_however_long_its_outputs_and_only_their_tail_is_decoded():
    """A candidate that completes a stop string ends its beam as a hypothesis after 150 outputs
    as after one, and the texts looked at stay as short as the stop string needs: the work of a
    step does not grow with the outputs (token 26 + n is letter n)."""
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    lengths: list[int] = []

    def decode(token_lists: list[list[int]], skip_special_tokens: bool) -> list[str]:
        lengths.extend(len(tokens) for tokens in token_lists)
        return ["".join(alphabet[t % 26] for t in tokens) for tokens in token_lists]

    s = Scheduler(SchedulerConfig(8, 32, 512, 256, BLOCK), decode=decode)
    for seq in choices(2, max_tokens=200, stop=("xyz",)):
        s.add(seq)

    def alphabet_walk(i, x):
        # the best candidate is the next letter, but no "y" before 150 outputs
        out = x.seq.output_ids
        letter = (out[-1] % 26 + 1) % 26 if out else 0
        if letter == 24 and len(out) < 150:
            letter = 25
        return np.array([26 + letter, 26 + 16]), np.log([0.9, 0.05]).astype(np.float32)

    emitted: list = []
    for _ in range(300):
        _, emitted = step(s, alphabet_walk)
        if emitted:
            break
    best = [token for seq, token in emitted if seq.handle == 10]
    text = decode([best], True)[0]
    # ended by the stop string, not by max_tokens (detokenize makes its finish "stop")
    assert 150 < len(best) < 200 and text.endswith("xyz") and "xyz" not in text[:-1]
    assert max(lengths[:-1]) <= len("xyz") + 12 + 1


def _byte_level_symbols() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the vocabulary entry of each byte (printable bytes as
    themselves, the others from U+0100 on)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def test_a_beams_tail_shows_the_stop_strings_its_whole_text_shows():
    """The tail BeamGroup decodes for stop strings finds them exactly where the whole output's
    text does (every output decoded, as before the tail), token by token as a beam grows: a real
    byte-level BPE tokenizer; outputs that spell each character a byte a token or merged, with
    runs of special tokens; stop strings cut from the text anywhere, so across token boundaries,
    and tails that start inside a character or among skipped tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tests.stages.tiny import CORPUS, SPECIALS

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    byte_ids = {b: tokenizer.token_to_id(symbol) for b, symbol in _byte_level_symbols().items()}
    end = tokenizer.token_to_id("<|im_end|>")
    decoded_lengths: list[int] = []

    def decode(token_lists: list[list[int]], skip_special_tokens: bool) -> list[str]:
        decoded_lengths.extend(len(tokens) for tokens in token_lists)
        return tokenizer.decode_batch(token_lists, skip_special_tokens=skip_special_tokens)

    def whole(tokens: list[int], skip: bool) -> str:
        return tokenizer.decode_batch([tokens], skip_special_tokens=skip)[0]

    text = "héllo wörld, 日本語のテキスト 🙂🚀 " * 6 + "the capital of France"
    rng = np.random.default_rng(0)
    num_hits = 0
    for _ in range(100):
        ids: list[int] = []
        for char in text:
            bytewise = rng.random() < 0.5
            ids += [byte_ids[b] for b in char.encode()] if bytewise else tokenizer.encode(char).ids
            ids += [end] * int(rng.integers(1, 12)) * (rng.random() < 0.3)
        skip = bool(rng.random() < 0.8)
        shown = whole(ids, skip)
        start = int(rng.integers(len(shown) // 2, len(shown) - 8))
        stop = shown[start : start + int(rng.integers(2, 8))]
        group = BeamGroup(BeamRequest(BeamSearchParams(2, group=1, index=0), (stop,), skip))
        for n in range(1, len(ids)):
            outputs = ids[:n]
            if stop in whole(outputs, skip):  # the beam would have ended
                break
            candidates = np.array([[ids[n], *rng.integers(0, tokenizer.get_vocab_size(), 3)]])
            found = group._stop_strings([SimpleNamespace(output_ids=outputs)], candidates, decode)
            expected = [[stop in whole([*outputs, int(c)], skip) for c in candidates[0]]]
            assert found.tolist() == expected, (stop, skip, n)
            num_hits += int(found.sum())
    assert num_hits >= 100  # each stop string was completed at least once
    assert max(decoded_lengths) < len(ids) // 4  # tails, never the whole output
