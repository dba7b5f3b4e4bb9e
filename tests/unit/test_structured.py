"""Structured output (generation/structured.py, generation/grammar.py): the parameter's
checks, llguidance's compiles and their refusals, and masks applied to logits, over a small
byte-level BPE tokenizer trained here (the real tokenizers and models: tests/test_generate.py,
tests/test_structured_families.py)."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from checks.schemas import TOO_MANY_ALTERNATIVES, byte_level_bpe, generate_batched

from triton_tlaloc.engine.speculation import accepted_drafts
from triton_tlaloc.generation.local_generation import Generation, Speculation
from triton_tlaloc.generation.parameters import SamplingError
from triton_tlaloc.generation.sampling import Sampler, SamplingParams
from triton_tlaloc.generation.grammar import GrammarObserver, Grammars
from triton_tlaloc.generation.structured import MAX_CONSTRAINT_BYTES, StructuredOutput
from triton_tlaloc.generation.speculative import StepCost
from triton_tlaloc.scheduling.admission import Reply

EOS = 0
VOCAB = 360  # more rows than the tokenizer's tokens, as a model's padded vocabulary has

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Lima", "Oslo"]},
        "pets": {"type": "array", "maxItems": 2, "items": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]},
                           "legs": {"type": "integer", "minimum": 0, "maximum": 4}},
            "required": ["kind", "legs"], "additionalProperties": False}},
    },
    "required": ["name", "age", "city", "pets"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A byte-level BPE of 354 tokens, <eos> id 0 (trained in about 20 ms)."""
    tok = byte_level_bpe(354, ["<eos>"])
    directory = tmp_path_factory.mktemp("tokenizer")
    (directory / "tokenizer.json").write_text(tok.to_str())
    return directory, tok


class Recorder(GrammarObserver):
    """What the grammar engine reports: its events in order, and each mask's time apart."""

    def __init__(self):
        self.events, self.masks = [], []
        self.forced_tokens = 0

    def constrained(self, kind):
        self.events.append(("constrained", kind))

    def compiled(self, kind, seconds):
        assert 0 <= seconds < 10
        self.events.append(("compiled", kind))

    def cache_hit(self, kind):
        self.events.append(("hit", kind))

    def masked(self, seconds):
        self.masks.append(seconds)

    def forced(self, tokens):
        self.forced_tokens += tokens


@pytest.fixture
def grammars(tokenizer):
    g = Grammars(tokenizer[0], VOCAB, [EOS], observer=Recorder())
    yield g
    g.close()


def spec(**d) -> StructuredOutput:
    return StructuredOutput.from_dict(d)


# ------------------------------------------------------------------ the parameter

@pytest.mark.parametrize("value, says", [
    ("json", "expected a JSON object with one of"),
    ({}, "exactly one of json_schema, json_object, regex, choice, grammar (given: none)"),
    ({"regex": "a", "choice": ["a"]}, "(given: regex, choice)"),
    ({"regex": "a", "schema": {}}, "(unknown: schema)"),
    ({"json_schema": "{}"}, "structured_output.json_schema '{}': expected a JSON schema object"),
    ({"json_object": 1}, "structured_output.json_object 1: expected true"),
    ({"choice": []}, "structured_output.choice []: expected a non-empty list"),
    ({"choice": ["a", ""]}, "expected a non-empty list of non-empty strings"),
    ({"choice": ["a"] * 1025}, "1025 choices: at most 1024"),
    ({"regex": ""}, "structured_output.regex '': expected a non-empty string"),
    ({"grammar": 5}, "structured_output.grammar 5: expected a non-empty string"),
    ({"regex": "a" * (MAX_CONSTRAINT_BYTES + 1)}, f"bytes: at most {MAX_CONSTRAINT_BYTES}"),
    ({"json_schema": {}, "strict": "yes"}, "structured_output.strict 'yes': expected true or"),
    ({"regex": "a", "strict": False}, "structured_output.strict: only with json_schema"),
])
def test_the_parameter_is_checked_by_name(value, says):
    with pytest.raises(SamplingError, match=re.escape(says)):
        SamplingParams.from_dict({"structured_output": value})


def test_the_parameter_survives_its_way_to_the_sequence_model():
    """to_dict is what the generate model sends over the local link: from_dict gives the same
    parameters back, for every kind (dataclasses.asdict would send the dataclass's fields)."""
    for d in ({"json_schema": PERSON, "strict": False}, {"json_object": True}, {"regex": "a+"},
              {"choice": ["yes", "no"]}, {"grammar": 'root ::= "a"'}):
        params = SamplingParams.from_dict({"structured_output": d, "seed": 3, "stop": ["x"]})
        assert SamplingParams.from_dict(params.to_dict()) == params
        assert params.structured_output.as_dict() == (d if "json_schema" not in d
                                                      else {**d})


# ------------------------------------------------------------------ compiling

@pytest.mark.parametrize("d, says", [
    ({"regex": "[a-"}, "structured_output.regex: "),
    ({"json_schema": {"type": "strin"}}, "structured_output.json_schema: Invalid type: strin"),
    ({"json_schema": {"$ref": "#/defs/x"}}, "Pointer '/defs/x' does not exist"),
    ({"json_schema": {"type": "string", "format": "weird"}}, "Unknown format: weird"),
    ({"grammar": "start: 'a' | "}, "structured_output.grammar: "),
])
def test_a_constraint_llguidance_cannot_compile_is_refused_with_its_reason(grammars, d, says):
    with pytest.raises(SamplingError, match=re.escape(says)):
        grammars.constraint(spec(**d), {EOS})
    assert grammars.compiles == 0


def test_not_strict_leaves_out_what_llguidance_lacks_and_compiles_are_cached(tokenizer):
    """The cache holds compiled grammars by content, the oldest out first; what happens is
    reported to the observer (the metrics)."""
    recorder = Recorder()
    grammars = Grammars(tokenizer[0], VOCAB, [EOS], cache_size=2, observer=recorder)
    weird = {"type": "string", "format": "weird"}
    grammars.constraint(spec(json_schema=weird, strict=False), {EOS})
    assert grammars.compiles == 1 and grammars.cache_hits == 0
    grammars.constraint(spec(json_schema=weird, strict=False), {EOS})
    assert grammars.compiles == 1 and grammars.cache_hits == 1
    grammars.constraint(spec(regex="a+"), {EOS})
    grammars.constraint(spec(regex="b+"), {EOS})  # the cache holds 2: the schema goes
    grammars.constraint(spec(json_schema=weird, strict=False), {EOS})
    assert grammars.compiles == 4 and grammars.cache_hits == 1
    c = grammars.constraint(spec(regex="a+"), {EOS})  # "a" forced: queued, no mask
    assert tokenizer[1].decode(c.queued) == "a"
    c.took(c.queued)
    c.took([int(np.flatnonzero(c.allowed())[0])])
    c.allowed()
    grammars.close()
    assert recorder.events == [("compiled", "json_schema"), ("constrained", "json_schema"),
                     ("hit", "json_schema"), ("constrained", "json_schema"),
                     ("compiled", "regex"), ("constrained", "regex"),
                     ("compiled", "regex"), ("constrained", "regex"),
                     ("compiled", "json_schema"), ("constrained", "json_schema"),
                     ("compiled", "regex"), ("constrained", "regex")]  # a+ went out
    assert len(recorder.masks) >= 5 + 1  # one a constraint, one after the chosen token
    assert recorder.forced_tokens >= 1  # the regex's "a"


def test_a_model_without_a_tokenizer_refuses_structured_output(tmp_path):
    with pytest.raises(SamplingError, match="has no tokenizer.json to constrain with"):
        Grammars(tmp_path, VOCAB, [EOS]).constraint(spec(regex="a"), {EOS})
    with pytest.raises(SamplingError, match="has no grammar engine"):
        Generation(1, [5], SamplingParams.from_dict({"structured_output": {"regex": "a"}}),
                   {EOS}, 64, lambda e: None, lambda r: None)


# ------------------------------------------------------------------ masks on logits

def run(constraint, params: SamplingParams, rng, steps: int = 300, shift: int = 0) -> list[int]:
    """Tokens chosen from seeded random logits under the constraint, until an end token."""
    sampler = Sampler(params)
    ids = []
    for _ in range(steps):
        if constraint.queued:  # forced: whatever the logits say
            token = constraint.queued[0]
        else:
            logits = constraint.masked(rng.standard_normal(VOCAB).astype(np.float32) * 4)
            if shift:  # the negative control: the mask one token id off
                allowed = np.roll(np.isfinite(logits), shift)
                logits = np.where(allowed, rng.standard_normal(VOCAB), -np.inf)
            token = int(np.argmax(logits)) if params.greedy else sampler.choose(logits)
        if token == EOS:
            return ids
        ids.append(token)
        constraint.took([token])
    raise AssertionError(f"no end after {steps} tokens")


CASES = [
    ({"json_schema": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
    ({"regex": r"[0-9]{3}-[a-z]{2,4}"},
     lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) or 1 / 0),
    ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe") or 1 / 0),
    ({"grammar": 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'},
     lambda t: re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", t) or 1 / 0),
]


@pytest.mark.parametrize("d, check", CASES, ids=[next(iter(c[0])) for c in CASES])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_k": 20, "top_p": 0.9,
                                           "seed": 1}], ids=["greedy", "sampled"])
def test_random_logits_under_a_grammar_give_answers_that_parse(grammars, tokenizer, d, check,
                                                               sampling):
    """Seeded random logits (no model): whatever they prefer, every answer keeps to its
    constraint and ends with the end token, for 5 seeds, greedy and sampled."""
    params = SamplingParams.from_dict({**sampling, "structured_output": d})
    masks = grammars.observer.masks
    for seed in range(5):
        before = len(masks)
        c = grammars.constraint(params.structured_output, {EOS})
        text = tokenizer[1].decode(run(c, params, np.random.default_rng(seed)))
        check(text)
        if "json_schema" in d:  # compact JSON, its keys in the schema's order
            assert json.dumps(json.loads(text), separators=(",", ":")) == text
            assert list(json.loads(text)) == list(PERSON["properties"])
        assert masks[before:] and max(masks[before:]) < 1.0


def written(c, tok, text: str):
    """Write `text` under the constraint `c` as a loop would: the queued (forced) tokens as
    they come, else the first token of what is left. Yields, before each token the model would
    choose, (the mask, the token, the text so far); forced tokens need no mask."""
    done = ""
    while done != text:
        if c.queued:
            token = c.queued[0]
        else:
            token = tok.encode(text[len(done):]).ids[0]
            yield c.allowed(), token, done
        piece = tok.decode([token])
        assert text.startswith(done + piece), (done, piece, text)
        done += piece
        c.took([token])


def test_any_json_object_starts_with_a_brace_and_ends_when_it_closes(grammars, tokenizer):
    """json_object (random logits would write an object without end, so its steps are
    written here): only tokens that begin an object come first, and the end is allowed once
    the object is closed."""
    tok = tokenizer[1]
    c = grammars.constraint(spec(json_object=True), {EOS})
    if c.queued:
        assert tok.decode(c.queued).startswith("{")
    else:
        first = np.flatnonzero(c.allowed())
        assert first.size and all(tok.decode([int(t)]).startswith("{") for t in first)
    steps = 0
    for allowed, token, _ in written(c, tok, '{"a":[1,true,null]}'):
        assert allowed[token] and not allowed[EOS]
        steps += 1
    assert steps and c.allowed()[EOS]


def test_end_tokens_are_allowed_exactly_when_the_grammar_accepts(grammars, tokenizer):
    """The tokenizer's EOS and the generation's other end ids (5 here, a byte token the
    grammar would never allow) are allowed after a whole answer and never inside one; past
    the tokenizer's last token nothing is allowed."""
    tok = tokenizer[1]
    c = grammars.constraint(spec(choice=["yes", "yes please"]), {EOS, 5})
    states = []
    for allowed, token, done in written(c, tok, "yes please"):
        assert allowed[EOS] == allowed[5] == c.matcher.is_accepting()
        assert not allowed[tok.get_vocab_size():].any()
        assert allowed[token]
        states.append((done, bool(allowed[EOS])))
    assert c.allowed()[EOS] and c.allowed()[5]  # after "yes please": complete
    assert c.allowed().sum() == 2  # and nothing may follow but an end
    # allowed before a token exactly where the text so far is a whole answer ("yes")
    assert all(eos == (done == "yes") for done, eos in states)
    assert ("yes", True) in states


def test_a_mask_one_token_id_off_is_caught(grammars):
    """The negative control: the same loop with the mask rolled by one id chooses a token the
    grammar refuses, and took() says so instead of going on."""
    params = SamplingParams.from_dict({"structured_output": {"json_schema": PERSON}})
    with pytest.raises(RuntimeError, match="the grammar refused token"):
        for seed in range(5):
            run(grammars.constraint(params.structured_output, {EOS}), params,
                np.random.default_rng(seed), shift=1)


def test_a_generation_under_a_grammar_emits_only_what_it_allows(grammars, tokenizer):
    """Generation (the sequence model's loop) with a constraint and one without, fed the same
    replies: the constrained one emits the choice's tokens and ends by stop at its end token,
    the free one emits the logits' argmax. A grammar that is complete with no end token left
    to end it (ignore_eos and no stop ids) ends by stop too."""
    events, queued = [], []
    params = SamplingParams.from_dict({"max_tokens": 20,
                                       "structured_output": {"choice": ["maybe"]}})
    gen = Generation(1, [7, 8], params, {EOS}, 64, events.append, queued.extend,
                     grammars=grammars)
    free = Generation(2, [7, 8], SamplingParams(max_tokens=3), {EOS}, 64, events.append,
                      queued.extend)
    favourite = 300  # a token the choice never allows
    row = np.zeros(VOCAB, np.float32)
    row[favourite] = 5.0
    for _ in range(10):
        if gen.finished:
            break
        gen.on_reply(Reply(logits=row))
    ids = [e[1] for e in events if e[0] == 1 and e[2] is None]
    assert tokenizer[1].decode(ids) == "maybe" and events[-1] == [1, -1, "stop"]
    free.on_reply(Reply(logits=row))
    assert events[-1] == [2, favourite, None]

    events.clear()
    params = SamplingParams.from_dict({"structured_output": {"choice": ["no"]},
                                       "ignore_eos": True})
    gen = Generation(3, [7], params, set(), 64, events.append, queued.extend,
                     grammars=grammars)
    for _ in range(5):
        if not gen.finished:
            gen.on_reply(Reply(logits=row))
    assert tokenizer[1].decode([e[1] for e in events if e[2] is None]) == "no"
    assert events[-1] == [3, -1, "stop"]


def test_a_grammar_past_the_parsers_limits_is_refused_or_ends_its_generation(grammars,
                                                                             tokenizer):
    """PARSER_LIMITS bound a grammar's work at each step, which compiling does not see: a
    grammar past them at its first step is refused by name before the generation starts; one
    past them only after the model's first choice ends its generation with the reason,
    INVALID_ARGUMENT, and ENDs its sequence."""
    with pytest.raises(SamplingError, match=r"structured_output\.grammar: .*max is 2000"):
        grammars.constraint(spec(grammar=f"start: {TOO_MANY_ALTERNATIVES}\n"), {EOS})
    events, queued = [], []
    params = SamplingParams.from_dict({"structured_output": {
        "grammar": f'start: ("a" | "b") x\nx: {TOO_MANY_ALTERNATIVES}\n'}})
    gen = Generation(1, [7], params, {EOS}, 64, events.append, queued.extend,
                     grammars=grammars)
    row = np.zeros(VOCAB, np.float32)
    row[tokenizer[1].token_to_id("a")] = 5.0
    gen.on_reply(Reply(logits=row))
    assert events[-1][:4] == [1, -1, "error", "INVALID_ARG"], events
    assert "the grammar failed at this step" in events[-1][4] and "max is 2000" in events[-1][4]
    assert gen.finished and queued[-1].end


# ------------------------------------------------------------------ fast-forward, speculation

class RandomModel:
    """Seeded logits for every history (drawn from its last three tokens), answering a
    generation's requests as the batcher would: a prompt or decode call with the logits after
    its last token; a verify call with its row's acceptor (else the argmax rule) over the
    logits after each position, the sequence cut back to what stood. Counts its calls."""

    def __init__(self, seed: int, ignore_acceptor: bool = False):
        self.seed, self.history, self.ignore_acceptor = seed, [], ignore_acceptor
        self.calls = self.verify_calls = 0
        self.drafts_stood = 0  # speculation's drafts (not forced tokens) that stood

    def logits(self, history: list[int]) -> np.ndarray:
        rng = np.random.default_rng([self.seed, *history[-3:]])
        return (rng.standard_normal(VOCAB) * 4).astype(np.float32)

    def answer(self, request) -> Reply:
        self.calls += 1
        self.history += request.tokens
        if not request.draft_tokens:
            return Reply(logits=self.logits(self.history))
        self.verify_calls += 1
        d = request.draft_tokens
        drafts, before = request.tokens[-d:], len(self.history) - d
        positions = np.stack([self.logits(self.history[:before + i]) for i in range(d + 1)])
        if request.acceptor is not None and not self.ignore_acceptor:
            stood, following = request.acceptor(positions, drafts)
        else:
            stood = accepted_drafts(drafts, positions.argmax(axis=1))
            following = int(np.argmax(positions[stood]))
        self.drafts_stood += max(0, stood - request.forced_tokens)
        del self.history[before + stood:]
        return Reply(accepted_ids=drafts[:stood] + [following])


VERIFIES = Speculation(most_drafts=8, refused=None, cost=StepCost((5, 9)))


def generate_with(grammars, model: RandomModel, prompt: list[int], params: SamplingParams,
                  speculation: Speculation | None) -> list[int]:
    """A local generation answered by `model` until its END: the ids it emitted."""
    events, queued = [], []
    gen = Generation(1, prompt, params, {EOS}, 4096, events.append, queued.extend,
                     speculation, grammars=grammars)
    queued.append(gen.start_request())
    while queued and not queued[0].end:
        gen.on_reply(model.answer(queued.pop(0)))
    if events[-1][2] != "stop":
        raise RuntimeError(f"the generation ended by {events[-1][2:]}")
    return [e[1] for e in events if e[2] is None]


def oracle(grammars, model: RandomModel, prompt: list[int]) -> list[int]:
    """Greedy ids under llguidance's mask with its forced tokens taken as they are, one token
    a step, from llguidance's API alone."""
    import llguidance
    import llguidance.numpy as llnp

    matcher = llguidance.LLMatcher(grammars.tokenizer(), grammars.grammar(spec(
        json_schema=PERSON)))
    bits = llnp.allocate_token_bitmask(1, VOCAB)
    ids = []
    while True:
        forced = matcher.compute_ff_tokens()
        matcher.consume_tokens(forced)
        ids += forced
        if matcher.is_stopped():
            return ids
        llnp.fill_next_token_bitmask(matcher, bits)
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:VOCAB].astype(bool)
        allowed[EOS] = matcher.is_accepting()
        token = int(np.argmax(np.where(allowed, model.logits(prompt + ids), -np.inf)))
        if token == EOS:
            return ids
        ids.append(token)
        assert matcher.consume_token(token)


def test_forced_tokens_fed_several_a_call_give_the_ids_of_one_a_step(grammars, tokenizer):
    """Fast-forward changes how forced tokens reach the model, never which: a generation on a
    model that verifies (forced tokens fed several in one verify call) emits the ids of one
    on a model that verifies none (a forced token a decode step, its logits unused), greedy
    and seeded sampled, in fewer calls; greedy, both equal the oracle built from llguidance
    alone, and every answer validates."""
    tok = tokenizer[1]
    prompt = tok.encode('{"name":"Ada","age":36}').ids
    for seed in range(4):
        for sampling in ({}, {"temperature": 1.0, "top_p": 0.9, "seed": seed}):
            params = SamplingParams.from_dict({**sampling, "max_tokens": 200,
                                               "structured_output": {"json_schema": PERSON}})
            one, several = RandomModel(seed), RandomModel(seed)
            ids = generate_with(grammars, one, prompt, params, None)
            assert generate_with(grammars, several, prompt, params, VERIFIES) == ids
            jsonschema.validate(json.loads(tok.decode(ids)), PERSON)
            assert several.verify_calls and several.calls < one.calls
            if not sampling:
                assert ids == oracle(grammars, RandomModel(seed), prompt)


def test_speculation_under_a_grammar_keeps_the_greedy_ids(grammars, tokenizer):
    """Prompt lookup under a grammar: drafts the grammar refuses are cut before the verify
    call, and drafts stand only where the grammar allows them, so greedy ids are those
    without speculation; the prompt holds the answer's pieces, so some drafts stand. The
    control: drafts kept by the model's argmax alone, unmasked, end in a token the grammar
    refuses or in other ids."""
    tok = tokenizer[1]
    prompt = tok.encode('{"name":"Ada","age":36,"city":"Paris","pets":[{"kind":"cat",'
                        '"legs":4}]}').ids
    speculating = SamplingParams.from_dict({
        "max_tokens": 200, "structured_output": {"json_schema": PERSON},
        "speculative": {"method": "prompt_lookup", "num_draft_tokens": 4,
                        "adaptive": False}})
    plain = SamplingParams.from_dict({"max_tokens": 200,
                                      "structured_output": {"json_schema": PERSON}})
    stood, caught = 0, 0
    for seed in range(4):
        ids = generate_with(grammars, RandomModel(seed), prompt, plain, VERIFIES)
        model = RandomModel(seed)
        assert generate_with(grammars, model, prompt, speculating, VERIFIES) == ids
        stood += model.drafts_stood
        try:
            caught += generate_with(grammars, RandomModel(seed, ignore_acceptor=True), prompt,
                                    speculating, VERIFIES) != ids
        except (RuntimeError, SamplingError) as e:
            assert re.search("the grammar (refused|forced) token", str(e))
            caught += 1
    assert stood and caught == 4


def batched(grammars, specs: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """Generations started together through a real batcher over the simulated runtime (a
    fake artifact of VOCAB tokens, batches 1 and 4, verify entries): the ids each emitted."""
    from checks.fakes import fake_artifact

    from triton_tlaloc.engine.core import Engine
    from triton_tlaloc.runtime.simulated import SimulatedRuntime

    art = fake_artifact(batch_ladder=(1, 4), context_ladder=(128,), vocab=VOCAB,
                        verify_tokens=(5, 9))
    return generate_batched(Engine(SimulatedRuntime(art, 0.0)), grammars, specs, EOS)


def test_rows_with_and_without_grammars_batched_together_keep_their_solo_ids(grammars,
                                                                             tokenizer):
    """Two generations under a JSON schema and a regex (their forced tokens fed in verify
    calls or one a step, as the round's times say) and two free ones, started together in
    shared calls: each gets the ids it gets alone."""
    json_params = SamplingParams.from_dict({"max_tokens": 100,
                                            "structured_output": {"json_schema": PERSON}})
    regex_params = SamplingParams.from_dict({"max_tokens": 40,
                                             "structured_output": {"regex": "[0-9]{3}-[a-z]+"}})
    free = SamplingParams(max_tokens=12, ignore_eos=True)
    specs = [([7, 8, 9], json_params), ([10, 11], free), ([12, 13, 14, 15], regex_params),
             ([16], free)]
    together = batched(grammars, specs)
    alone = [batched(grammars, [spec])[0] for spec in specs]
    assert together == alone
    jsonschema.validate(json.loads(tokenizer[1].decode(alone[0])), PERSON)
    assert re.fullmatch("[0-9]{3}-[a-z]+", tokenizer[1].decode(alone[2]))
    assert len(alone[1]) == len(alone[3]) == 12
