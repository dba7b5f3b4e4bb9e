"""Structured output (generation/structured.py, generation/grammar.py): the parameter's
checks, llguidance's compiles and their refusals, and masks applied to logits, over a small
byte-level BPE tokenizer trained here (the real tokenizers and models: tests/test_generate.py,
tests/test_structured_families.py)."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import numpy as np
import pytest

from checks.schemas import TOO_MANY_ALTERNATIVES, byte_level_bpe, generate_batched

from triton_tlaloc.engine.speculation import accepted_drafts
from triton_tlaloc.generation.local_generation import Generation, Speculation
from triton_tlaloc.generation.parameters import SamplingError
from triton_tlaloc.generation.sampling import Sampler, SamplingParams
from triton_tlaloc.generation.grammar import Grammars, GrammarsBusy, llguidance_grammar
from triton_tlaloc.generation.token_constraint import GrammarObserver
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

    matcher = llguidance.LLMatcher(grammars.tokenizer(), llguidance_grammar(spec(
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


# ------------------------------------------------------------------ the compiles: off the way

class HeldGrammars(Grammars):
    """Grammars whose compiles wait for `release` (a compile as slow as a test needs) and
    record what they compiled; `inline`: the caller's thread waits as long first, as when the
    link's reader thread compiled (the known-wrong variant)."""

    def __init__(self, *args, inline: bool = False, **kw):
        super().__init__(*args, **kw)
        self.release, self.inline = threading.Event(), inline
        self.compiled_texts: list[str] = []

    def prepare(self, spec, stops, done):
        if self.inline:
            self.release.wait(10)
        return super().prepare(spec, stops, done)

    def _compile(self, spec):
        self.compiled_texts.append(spec.text)
        self.release.wait(10)
        return super()._compile(spec)


class Answers:
    """`done`'s answers, by name, as they come."""

    def __init__(self):
        self.got: dict[str, tuple] = {}
        self.cv = threading.Condition()

    def done(self, name: str):
        def answer(constraint, error):
            with self.cv:
                self.got[name] = (constraint, error, time.monotonic())
                self.cv.notify_all()
        return answer

    def wait(self, *names: str, timeout: float) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: all(n in self.got for n in names), timeout)


@pytest.mark.parametrize("inline", [False, True], ids=["compile threads", "control: in line"])
def test_a_compile_never_holds_the_callers_thread_and_one_serves_all_who_ask(tokenizer,
                                                                              inline):
    """`prepare` returns at once while the compile runs (held here for 0.5 s), and two
    generations asking for the same constraint meanwhile share one compile (the second
    counted as a hit); both get a constraint of their own. Control: the in-line variant (the
    reader thread compiling, as before) holds the caller for the whole compile."""
    grammars = HeldGrammars(tokenizer[0], VOCAB, [EOS], inline=inline)
    answers = Answers()
    releaser = threading.Timer(0.5, grammars.release.set)
    releaser.start()
    t0 = time.monotonic()
    first = grammars.prepare(spec(regex="[0-9]{3}"), {EOS}, answers.done("first"))
    second = grammars.prepare(spec(regex="[0-9]{3}"), {EOS}, answers.done("second"))
    held = time.monotonic() - t0
    try:
        if inline:
            assert held >= 0.45
            return
        assert held < 0.25 and not answers.got
        assert answers.wait("first", "second", timeout=10)
        (a, error_a, _), (b, error_b, _) = answers.got["first"], answers.got["second"]
        assert error_a is error_b is None and a is not b and a.matcher is not b.matcher
        assert grammars.compiled_texts == ["[0-9]{3}"]
        assert grammars.compiles == 1 and grammars.cache_hits == 1
        assert not first.cancel() and not second.cancel()  # answered: nothing to take back
    finally:
        releaser.cancel()
        grammars.release.set()
        grammars.close()


@pytest.mark.parametrize("limit", [0.3, 30.0], ids=["limit 0.3 s", "control: limit 30 s"])
def test_a_slow_compile_is_refused_by_name_and_what_waits_behind_it_as_busy(tokenizer, limit):
    """One compile thread, one place to wait: a compile held past its 0.3 s is refused
    (INVALID_ARGUMENT's SamplingError, naming the limit) at its deadline, not when it ends,
    and so is its constraint, at once and without a second compile, while it still runs;
    once it ends, its result is kept (a retry finds it compiled). The one that waited 0.3 s
    for the thread is refused as busy; a third finds the queue full (busy at once). Control:
    with a 30 s limit nothing is answered before the compile ends."""
    grammars = HeldGrammars(tokenizer[0], VOCAB, [EOS], threads=1, waiting=1,
                            compile_seconds=limit)
    answers = Answers()
    try:
        t0 = time.monotonic()
        grammars.prepare(spec(regex="a[0-9]+"), {EOS}, answers.done("slow"))
        for _ in range(100):  # the thread took it: the next one waits
            if grammars.compiled_texts:
                break
            time.sleep(0.01)
        grammars.prepare(spec(regex="b[0-9]+"), {EOS}, answers.done("waiting"))
        grammars.prepare(spec(regex="c[0-9]+"), {EOS}, answers.done("full"))
        assert answers.wait("full", timeout=0.2)
        assert isinstance(answers.got["full"][1], GrammarsBusy)
        answered = answers.wait("slow", "waiting", timeout=3)
        if limit > 1:
            assert not answered and set(answers.got) == {"full"}
            return
        assert answered
        _, error, at = answers.got["slow"]
        assert isinstance(error, SamplingError) and at - t0 < 2.5
        assert "structured_output.regex: took more than 0.3 s to compile" in str(error)
        assert isinstance(answers.got["waiting"][1], GrammarsBusy)
        assert "no compile thread free within 0.3 s" in str(answers.got["waiting"][1])
        grammars.prepare(spec(regex="a[0-9]+"), {EOS}, answers.done("again"))
        assert "took more than 0.3 s" in str(answers.got["again"][1])  # at once, no compile
        grammars.release.set()
        for _ in range(500):  # the compile ends by itself
            if grammars.compiles:
                break
            time.sleep(0.01)
        grammars.prepare(spec(regex="a[0-9]+"), {EOS}, answers.done("retry"))
        constraint, error, _ = answers.got["retry"]  # answered at once: found compiled
        assert error is None and constraint is not None and grammars.cache_hits == 1
        assert grammars.compiled_texts == ["a[0-9]+"]
    finally:
        grammars.release.set()
        grammars.close()


@pytest.mark.parametrize("cancel", [True, False], ids=["cancelled", "control: not cancelled"])
def test_a_compile_whose_generations_went_away_is_dropped_before_it_starts(tokenizer, cancel):
    """A compile waiting for the one thread, whose only generation is cancelled (its client
    went away), is never compiled and its `done` never called. Control: not cancelled, it
    is compiled once the thread is free."""
    grammars = HeldGrammars(tokenizer[0], VOCAB, [EOS], threads=1)
    answers = Answers()
    try:
        grammars.prepare(spec(regex="a[0-9]+"), {EOS}, answers.done("first"))
        waiting = grammars.prepare(spec(regex="b[0-9]+"), {EOS}, answers.done("waiting"))
        if cancel:
            assert waiting.cancel() and not waiting.cancel()
        grammars.release.set()
        assert answers.wait("first", timeout=10)
        assert answers.wait("waiting", timeout=1) is not cancel
        assert grammars.compiled_texts == ["a[0-9]+"] + ([] if cancel else ["b[0-9]+"])
    finally:
        grammars.release.set()
        grammars.close()


# ------------------------------------------------------------------ forced tokens, limits

def started_within(request_tokens: list[int], prompt: list[int], max_tokens: int,
                   max_context: int) -> bool:
    """Whether a START leaves room for the token after it within max_tokens and the context
    (forced tokens fed in it count as generated ones)."""
    fed = len(request_tokens) - len(prompt)
    return request_tokens[:len(prompt)] == prompt and fed + 1 <= max_tokens and \
        len(request_tokens) + 1 <= max_context


def run_local(gen: Generation, queued: list, logits: np.ndarray, steps: int = 50) -> None:
    """Answers `gen`'s requests with `logits` until its END."""
    queued.append(gen.start_request())
    for _ in range(steps):
        request = queued.pop(0)
        if request.end:
            return
        gen.on_reply(Reply(logits=logits))
    raise AssertionError("no END")


@pytest.mark.parametrize("regex, complete", [("x{300}", True), ("x{300}[ab]", False)])
@pytest.mark.parametrize("max_tokens, max_context", [(1, 4096), (5, 4096), (100, 12)])
def test_forced_tokens_count_against_max_tokens_and_the_context(grammars, tokenizer, regex,
                                                                 complete, max_tokens,
                                                                 max_context):
    """`x{300}` (its answer all forced) and `x{300}[ab]` (a choice after them): the START
    feeds no more forced tokens than max_tokens and the context leave room for with the token
    after them (none when the answer ends with them: nothing needs their logits), and the
    generation ends by length after max_tokens tokens (or at the context), the text all x.
    Control: the START as it was (the prompt and every forced token, when they fit the
    context) fails the same check."""
    prompt = [7, 8, 9]
    events, queued = [], []
    params = SamplingParams.from_dict({"max_tokens": max_tokens,
                                       "structured_output": {"regex": regex}})
    gen = Generation(1, prompt, params, {EOS}, max_context, events.append, queued.extend,
                     grammars=grammars)
    assert gen.constraint.complete is complete and len(gen.constraint.queued) >= 100
    start = gen.start_request()
    assert started_within(start.tokens, prompt, max_tokens, max_context)
    assert len(start.tokens) == (len(prompt) if complete else
                                 min(len(prompt) + max_tokens, max_context) - 1)
    run_local(gen, queued, np.zeros(VOCAB, np.float32))
    ids = [e[1] for e in events if e[1] >= 0]
    assert len(ids) == min(max_tokens, max_context - len(prompt)) and events[-1][2] == "length"
    assert set(tokenizer[1].decode(ids)) == {"x"}

    old = prompt + gen.constraint.queued  # (the queue now: fewer than it was)
    if len(old) < max_context:
        assert not started_within(old, prompt, max_tokens, max_context)


def test_a_grammar_that_never_ends_ends_by_length(grammars, tokenizer):
    """`start: "ab" start` forces "ab" for ever: llguidance computes its forced tokens
    (about 25,000) but its parser cannot take them (its item limit, counted again as it takes
    them). The generation emits them and ends by length at max_tokens or at the context,
    feeding only its prompt; as vLLM does, no error. Control: llguidance's own matcher
    does fail to take them (what refused the request before)."""
    import llguidance

    from triton_tlaloc.generation.token_constraint import FORCED_PAST_LIMIT

    never = 'start: "ab" start'
    for max_tokens, max_context in ((12, 4096), (4000, 40)):
        events, queued = [], []
        params = SamplingParams.from_dict({"max_tokens": max_tokens,
                                           "structured_output": {"grammar": never}})
        gen = Generation(1, [7, 8], params, {EOS}, max_context, events.append,
                         queued.extend, grammars=grammars)
        assert gen.start_request().tokens == [7, 8]
        run_local(gen, queued, np.zeros(VOCAB, np.float32))
        ids = [e[1] for e in events if e[1] >= 0]
        assert len(ids) == min(max_tokens, max_context - 2) and events[-1][2] == "length"
        assert set(tokenizer[1].decode(ids)) == {"a", "b"}
    matcher = llguidance.LLMatcher(grammars.tokenizer(), llguidance_grammar(spec(
        grammar=never)), limits=grammars._limits)
    forced = matcher.compute_ff_tokens()
    assert len(forced) > 10_000 and not matcher.consume_tokens(forced)
    assert FORCED_PAST_LIMIT in matcher.get_error()
