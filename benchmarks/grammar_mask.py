"""The cost of constrained decoding per decoded token: the grammar mask against a decode step.

For each grammar (a nested JSON schema, JSON mode, a required tool call in the generic format), the
model first answers one prompt greedily under that grammar; the answer's tokens are then replayed
through a fresh ``GrammarProcessor`` ``--rounds`` times, timing per token its two parts: the mask
(llguidance's ``LLMatcher`` bitmask, unpacked to ``[V]`` booleans) and the rest of ``process`` +
``accept`` (the ``-inf`` fill of the logits row and the matcher's advance). One plain decode step
of the model (``forward_batch`` of one row at the answer's context, rolled back) is timed in the
same rounds, interleaved, so that machine noise hits both alike. Medians over all tokens and
rounds are printed, with the mask's share of a decode step.

    python benchmarks/grammar_mask.py [--tag smollm2:135m] [--rounds 20] [--max-tokens 120]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from flm_runtime.api import get_engine
from flm_runtime.request import SamplingParams
from flm_runtime.sampling.grammar import compiler_for, json_object_grammar, json_schema_grammar, lark_grammar
from flm_runtime.text import tool_format

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["engineer", "doctor", "teacher"]},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "role", "skills", "address"]}
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}
CASES = {
    "json_schema": ("Describe a software engineer called Ada as JSON.", json_schema_grammar(PERSON), None),
    "json_object": ('Give me a JSON object describing a cat, with keys "name" and "color".', json_object_grammar(),
                    None),
    "tool_call": ("What is the weather in Paris?",
                  lark_grammar(tool_format.tool_grammar([WEATHER], "required", parallel=True)), [WEATHER]),
}


def answer(engine, question: str, grammar: str, functions, max_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of the greedy constrained answer."""
    tok = engine.tokenizer
    messages = tool_format.render_messages([{"role": "user", "content": question}], functions)
    prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    done = engine.submit(prompt, SamplingParams(max_tokens=max_tokens),
                         processors=[compiler_for(tok).processor(grammar)]).result()
    return prompt, list(done.token_ids)


def replay(compiler, grammar: str, tokens: list[int], vocab: int) -> tuple[list[float], list[float]]:
    """Seconds per token of the mask, and of the fill + advance, over one replay of ``tokens``."""
    proc = compiler.processor(grammar)
    row = np.random.default_rng(0).standard_normal(vocab).astype(np.float32)
    mask_s, rest_s = [], []
    for token in tokens:
        logits = row.copy()
        t0 = time.perf_counter()
        allowed = proc.allowed()
        t1 = time.perf_counter()
        np.putmask(logits, ~allowed, -np.inf)
        proc.accept(token)
        t2 = time.perf_counter()
        mask_s.append(t1 - t0)
        rest_s.append(t2 - t1)
    return mask_s, rest_s


def decode_step_s(model, prompt: list[int], tokens: list[int]) -> float:
    """Seconds of one plain decode step after the prompt and the answer, rolled back; the second of
    two such steps (the first, right after the prefill, also pays for what the prefill left
    behind: other threads still spinning, other data in the caches)."""
    cache = model.new_cache(len(prompt) + len(tokens) + 1)
    model.forward_batch([np.asarray(prompt + tokens[:-1], dtype=np.int64)], [cache])
    n = cache.length
    for _ in range(2):
        t0 = time.perf_counter()
        model.forward_batch([np.asarray(tokens[-1:], dtype=np.int64)], [cache])
        t = time.perf_counter() - t0
        cache.trim(n)
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tag", default="smollm2:135m")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=120)
    args = parser.parse_args()
    engine = get_engine(args.tag)
    compiler = compiler_for(engine.tokenizer)
    vocab = int(engine.model.config.vocab_size)
    answers = {name: answer(engine, q, g, f, args.max_tokens) for name, (q, g, f) in CASES.items()}
    times = {name: ([], [], []) for name in CASES}
    for _ in range(args.rounds):
        for name, (_, grammar, _) in CASES.items():
            prompt, tokens = answers[name]
            mask_s, rest_s = replay(compiler, grammar, tokens, vocab)
            times[name][0].extend(mask_s)
            times[name][1].extend(rest_s)
            times[name][2].append(decode_step_s(engine.model, prompt, tokens))
    print(f"{args.tag}: vocabulary {vocab}, {args.rounds} rounds; medians per decoded token")
    print(f"{'grammar':<12} {'tokens':>6} {'mask us':>9} {'fill+accept us':>15} {'decode step us':>15} {'share':>7}")
    for name, (mask_s, rest_s, step_s) in times.items():
        mask, rest, step = (statistics.median(x) * 1e6 for x in (mask_s, rest_s, step_s))
        print(f"{name:<12} {len(answers[name][1]):>6} {mask:>9.1f} {rest:>15.1f} {step:>15.1f} "
              f"{(mask + rest) / step:>7.1%}")
    engine.close()


if __name__ == "__main__":
    main()
