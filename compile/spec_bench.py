"""spec: what speculative decoding buys, and what it costs where it cannot pay
(``python compilebench.py spec``; ``--rows ngram`` for one part, ``--skip-llama-cpp`` without
the peer).

Three parts (``--rows``, default all three):

* ``ngram``: prompt lookup where the reply copies its input, batch 1, nanoserve compiled with
  ``auto`` weights, ``{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
  "prompt_lookup_min": 2}`` against the same engine without speculation. Two workloads: ``code``
  asks for a Python file (compile/texts/spec_code.txt, a frozen copy of nanoserve/speculative/ngram.py)
  to be rewritten with one name changed, otherwise unchanged; ``quote`` asks for a summary of the
  opening of compile/texts/fidelity.txt that quotes its key sentences verbatim. Beside it
  llama.cpp on the same GGUF file and the same token ids, through llama-cpp-python's ``Llama``
  without and with ``draft_model=LlamaPromptLookupDecoding(max_ngram_size=4,
  num_pred_tokens=K)`` (its n-grams go down to one token and it takes the earliest copy; ours
  2-4 tokens, the latest copy). Bar: nanoserve's ngram at least 1.5x its no-speculation arm.
* ``draft``: the same workloads, batch 1, the fp32 target (``weights="fp32"``) drafted by its
  own int4 blocks (``{"method": "draft", "num_speculative_tokens": K}``) against fp32 alone;
  ``same_tokens`` says whether the greedy tokens are identical.
* ``batch``: the headline's workload (random 32-token prompts, ``--batch-new-tokens`` 128 tokens
  each, compile/headline.py, no copying) at ``--batches`` (8 and 32): ``auto`` with and without ngram, fp32 with and without draft.
  Bar: at least 0.95x (speculation, or the engine turning it off, must not cost a batch).

Prompts are chat-templated with the model's template (plain text for a model without one);
decoding is greedy, ``--new-tokens`` per row with EOS ignored, so every system emits as many
tokens. Every arm (system x weights x method, per part) runs alone in a fresh process, one after
the other, so OpenMP threads never fight and no memory is shared. In its process each job
(workload x batch) runs once untimed, which builds every graph the timed runs hit (with
speculation the verify graphs are built on first use per (rows, k+1, width) bucket: the same
greedy run hits the same buckets; ``graphs_built_timed`` checks it), then ``--repeats`` timed
runs; figures are medians, counters per run.

Columns: ``tok_s`` decode tokens/s (tokens emitted after every row had its first token, over
the time since: prefill left out, ``prefill_s`` apart); ``ratio`` over the same system's and
weights' no-speculation arm (``bar``, ``meets``); on nanoserve's ngram rows ``vs_llama`` (over
llama.cpp's tok/s with the same method) and ``llama_ratio`` (llama.cpp's own speed-up);
``acceptance_rate``, ``mean_accepted_length`` (tokens a verifying row emits per verify step),
``verify_steps``, ``proposed``, ``accepted``, ``draft_s``, ``verify_s`` (per run; llama.cpp's
are counted from its proposer's calls, no verify time), ``recompiles_after_warmup``,
``same_tokens`` (rows whose greedy tokens equal the no-speculation arm's) and ``first_diff``.
Writes ``compile/results/runs/spec[-MODEL][-TAG].csv`` and ``.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from compile import llama_peer
from compile.common import (
    FIDELITY_TEXT,
    HERE,
    add_output_options,
    format_table,
    host_description,
    int_list,
    make_prompts,
    name_list,
    pyplot,
    result_stem,
    save_figure,
    write_results,
)
from nanoserve.model.formats.loader import DEFAULT_MODEL

PARTS = ("ngram", "draft", "batch")
NANOSERVE, LLAMA_CPP = "nanoserve", llama_peer.NAME
CODE_TEXT = HERE / "texts" / "spec_code.txt"
SUMMARY_CHARS = 2000  # the opening paragraphs of the fidelity text, cut at a paragraph's end
HEADLINE_PROMPT_LEN = 32  # compile/headline.py's prompts: random token ids
HEADLINE_NEW_TOKENS = 128  # and its tokens per row (the batch part's default)
LOOKUP_MAX, LOOKUP_MIN = 4, 2
BARS = {"ngram": 1.5, "batch": 0.95}  # the least ratio a part's speculating nanoserve rows should reach

# What each workload asks (the text follows the instruction).
INSTRUCTIONS = {
    "code": ("Rewrite the following Python file, renaming the variable `history` to `past` everywhere. "
             "Change nothing else: reproduce every other line exactly as it is. Reply with the whole file only."),
    "quote": ("Summarise the following text in a few paragraphs. Quote its key sentences verbatim, in "
              "quotation marks, and keep their wording exactly."),
}
COLUMNS = ["part", "workload", "batch", "system", "weights", "method", "k", "tok_s", "ratio", "bar", "meets",
           "vs_llama", "llama_ratio", "acceptance_rate", "mean_accepted_length", "verify_steps", "draft_s",
           "verify_s", "recompiles_after_warmup", "graphs_built_timed", "same_tokens", "first_diff", "prefill_s",
           "prompt_tokens", "error"]


# --- the workloads -------------------------------------------------------------------------------

def source_text(workload: str, chars: int | None = None) -> str:
    """The text a copying workload hands the model (its first ``chars`` characters, if given)."""
    if workload == "code":
        text = CODE_TEXT.read_text()
    else:
        text = ""
        for paragraph in FIDELITY_TEXT.read_text().split("\n\n"):
            if text and len(text) + len(paragraph) > SUMMARY_CHARS:
                break
            text += paragraph + "\n\n"
        text = text.strip() + "\n"
    return text[:chars] if chars else text


def chat_prompt(tokenizer, workload: str, chars: int | None = None) -> list[int]:
    """The workload's request as token ids: the model's chat template around one user message
    (the instruction, then the text), or that message alone for a model without a template."""
    message = f"{INSTRUCTIONS[workload]}\n\n{source_text(workload, chars)}"
    if tokenizer.chat_template is None:
        return tokenizer.encode(message)
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=True)


@dataclasses.dataclass(frozen=True)
class Arm:
    """One process: a system with one weight format and one speculation method, and its jobs."""

    part: str
    system: str
    weights: str
    method: str  # "none", "ngram" or "draft"
    jobs: tuple[tuple[str, int], ...]  # (workload, batch)


def plan_arms(parts: Sequence[str], batches: Sequence[int], llama_cpp: bool) -> list[Arm]:
    """Every arm the chosen parts need, each part's no-speculation arm right before its own."""
    copying = (("code", 1), ("quote", 1))
    arms = []
    if "ngram" in parts:
        arms += [Arm("ngram", NANOSERVE, "auto", method, copying) for method in ("none", "ngram")]
        if llama_cpp:
            arms += [Arm("ngram", LLAMA_CPP, "file", method, copying) for method in ("none", "ngram")]
    if "draft" in parts:
        arms += [Arm("draft", NANOSERVE, "fp32", method, copying) for method in ("none", "draft")]
    if "batch" in parts:
        jobs = tuple(("headline", b) for b in batches)
        for weights, method in (("auto", "ngram"), ("fp32", "draft")):
            arms += [Arm("batch", NANOSERVE, weights, m, jobs) for m in ("none", method)]
    return arms


def speculative_config(method: str, k: int, extra: dict, draft_extra: dict) -> dict | None:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": LOOKUP_MAX,
                "prompt_lookup_min": LOOKUP_MIN, **extra}
    if method == "draft":
        return {"method": "draft", "num_speculative_tokens": k, **extra, **draft_extra}
    return None


# --- one arm's process ---------------------------------------------------------------------------

def decode_run(engine, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float, float]:
    """One greedy run of ``prompts`` to ``new_tokens`` each: (tokens per row, seconds until every
    row had its first token, decode tokens/s after that)."""
    from nanoserve.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    emitted: dict[str, list[int]] = {}
    start, first, at_first = time.perf_counter(), None, 0
    while engine.has_unfinished():
        for out in engine.step():
            emitted[out.request_id] = list(out.token_ids)
        if first is None and len(emitted) == len(ids) and all(emitted.values()):
            first, at_first = time.perf_counter(), sum(len(t) for t in emitted.values())
    end = time.perf_counter()
    tokens = [emitted.get(i, []) for i in ids]
    decoded = sum(len(t) for t in tokens) - at_first
    return tokens, first - start, decoded / (end - first) if end > first else 0.0


def measure_nanoserve(spec: dict) -> list[dict]:
    from nanoserve.engine import build_engine

    longest = max(len(p) for job in spec["jobs"] for p in job["prompts"])
    options = dict(max_batch_size=max(job["batch"] for job in spec["jobs"]), compile=spec["compile"], warmup="eager",
                   max_model_len=longest + spec["new_tokens"] + spec["k"] + 16, enable_prefix_caching=False,
                   weights=spec["weights"])
    if spec["speculative"] is not None:
        options["speculative"] = spec["speculative"]
    engine = build_engine(spec["model"], **options)
    results = []
    for job in spec["jobs"]:
        # Builds every graph the runs below hit: twice, since a row's speculation length is priced
        # from step times measured in the first run, and a new length may need a new verify shape.
        for _ in range(2):
            decode_run(engine, job["prompts"], spec["new_tokens"])
        spec_before = _spec_counts(engine)
        built_before = engine.stats().graphs_built
        runs = [decode_run(engine, job["prompts"], spec["new_tokens"]) for _ in range(spec["repeats"])]
        stats = engine.stats()
        row = dict(tok_s=statistics.median(r[2] for r in runs), prefill_s=statistics.median(r[1] for r in runs),
                   tokens=runs[0][0], recompiles_after_warmup=stats.recompiles_after_warmup,
                   graphs_built_timed=stats.graphs_built - built_before, engine_kernels=stats.cpu_kernels,
                   engine_dtype=stats.compute_dtype, resolved_weights=stats.weights)
        if spec_before is not None:
            row.update(_spec_row({key: (value - spec_before[key]) / spec["repeats"]
                                  for key, value in _spec_counts(engine).items()}))
        results.append(row)
    engine.close()
    return results


def _spec_counts(engine) -> dict | None:
    if engine.speculator is None:
        return None
    return dataclasses.asdict(engine.speculator.stats)


def _spec_row(per_run: dict) -> dict:
    """The speculation columns from one run's counters (SpecStats' fields)."""
    proposed, accepted, rows = per_run["proposed"], per_run["accepted"], per_run["verify_rows"]
    return dict(verify_steps=per_run["verify_steps"], proposed=proposed, accepted=accepted,
                acceptance_rate=accepted / proposed if proposed else 0.0,
                mean_accepted_length=(accepted + rows) / rows if rows else 0.0,
                draft_s=per_run["draft_seconds"], verify_s=per_run["verify_seconds"])


class CountedLookup:
    """llama-cpp-python's prompt lookup, counting its calls, its proposals and its time."""

    def __init__(self, k: int) -> None:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.lookup = LlamaPromptLookupDecoding(max_ngram_size=LOOKUP_MAX, num_pred_tokens=k)
        self.calls = self.verify_steps = self.proposed = 0
        self.seconds = 0.0

    def __call__(self, input_ids, **kwargs):
        started = time.perf_counter()
        draft = self.lookup(input_ids, **kwargs)
        self.seconds += time.perf_counter() - started
        self.calls += 1
        self.verify_steps += len(draft) > 0
        self.proposed += len(draft)
        return draft


@contextlib.contextmanager
def _no_repack(llama_cpp):
    """llama.cpp's weights unrepacked, as compile/llama_peer.py runs them (repacked into AMX
    tiles, llama_decode segfaults on this project's VM): the high-level ``Llama`` has no
    option for it, so its default model parameters are patched while it loads."""
    default = llama_cpp.llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama.llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        llama_cpp.llama.llama_cpp.llama_model_default_params = default


def measure_llama_cpp(spec: dict) -> list[dict]:
    import llama_cpp
    import llama_cpp.llama  # noqa: F401  (the module _no_repack patches)

    if any(job["batch"] != 1 for job in spec["jobs"]):
        raise ValueError("the llama.cpp arm runs batch 1 only (llama-cpp-python's speculation is single-sequence)")
    longest = max(len(job["prompts"][0]) for job in spec["jobs"])
    threads = torch.get_num_threads()
    lookup = CountedLookup(spec["k"]) if spec["method"] == "ngram" else None
    with _no_repack(llama_cpp):
        # A draft model's tokens are verified from every position's logits: llama-cpp-python keeps
        # them only with logits_all (else a prompt past n_batch leaves no room for them).
        llm = llama_cpp.Llama(spec["gguf"], n_ctx=longest + spec["new_tokens"] + spec["k"] + 16, n_batch=512,
                              n_threads=threads, n_threads_batch=threads, verbose=False, draft_model=lookup,
                              logits_all=lookup is not None)

    def run(prompt: list[int]) -> tuple[list[int], float, float]:
        llm.reset()  # no prompt reuse between runs: each one prefills, as nanoserve's does
        tokens, start, first = [], time.perf_counter(), None
        for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):
            tokens.append(int(token))
            if first is None:
                first = time.perf_counter()
            if len(tokens) >= spec["new_tokens"]:
                break
        end = time.perf_counter()
        return tokens, first - start, (len(tokens) - 1) / (end - first) if end > first else 0.0

    results = []
    for job in spec["jobs"]:
        prompt = job["prompts"][0]
        run(prompt)
        before = dict(vars(lookup)) if lookup is not None else {}  # the counts so far
        runs = [run(prompt) for _ in range(spec["repeats"])]
        row = dict(tok_s=statistics.median(r[2] for r in runs), prefill_s=statistics.median(r[1] for r in runs),
                   tokens=[runs[0][0]])
        if lookup is not None:
            n = spec["repeats"]
            calls = (lookup.calls - before["calls"]) / n
            steps = (lookup.verify_steps - before["verify_steps"]) / n
            # Each call precedes one llama_decode, which emits its accepted proposals and one token.
            accepted = (spec["new_tokens"] - 1) - calls
            row.update(verify_steps=steps, proposed=(lookup.proposed - before["proposed"]) / n, accepted=accepted,
                       draft_s=(lookup.seconds - before["seconds"]) / n)
            row["acceptance_rate"] = accepted / row["proposed"] if row["proposed"] else 0.0
            row["mean_accepted_length"] = (accepted + steps) / steps if steps else 0.0
        results.append(row)
    info = llama_cpp.llama_print_system_info().decode()
    for row in results:
        row["kernels"] = "llama.cpp " + "+".join(name for name in ("AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16")
                                                 if f"{name} = 1" in info)
    llm.close()
    return results


def worker(path: Path) -> int:
    spec = json.loads(path.read_text())
    torch.set_grad_enabled(False)
    measure = measure_llama_cpp if spec["system"] == LLAMA_CPP else measure_nanoserve
    print(json.dumps(measure(spec)))
    return 0


def run_alone(spec: dict) -> list[dict]:
    """One arm's jobs in a fresh process (nothing else running, no memory shared); on failure,
    one row per job saying why."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        done = subprocess.run([sys.executable, "-m", "compile.spec_bench", "--worker", f.name],
                              capture_output=True, text=True, env=dict(os.environ), cwd=HERE.parent)
    finally:
        os.unlink(f.name)
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return [dict(error=f"exit {done.returncode}: {' | '.join(tail)}") for _ in spec["jobs"]]
    return json.loads(lines[-1])


# --- the table -----------------------------------------------------------------------------------

def compare(rows: list[dict], tokens: dict[int, list[list[int]]]) -> None:
    """Each speculating row against its no-speculation arm (same part, workload, batch, system,
    weights): ratio, bar, same tokens; nanoserve's ngram rows against llama.cpp's."""
    def key(row, method="none", system=None):
        return (row["part"], row["workload"], row["batch"], system or row["system"], row["weights"], method)

    index = {key(r, r["method"]): i for i, r in enumerate(rows)}
    for i, row in enumerate(rows):
        base = index.get(key(row))
        if row["method"] == "none" or "error" in row or base is None or "error" in rows[base]:
            continue
        row["ratio"] = row["tok_s"] / rows[base]["tok_s"] if rows[base]["tok_s"] else 0.0
        same = [a == b for a, b in zip(tokens[i], tokens[base])]
        row["same_tokens"] = f"{sum(same)}/{len(same)}"
        diffs = [_first_diff(a, b) for a, b in zip(tokens[i], tokens[base]) if a != b]
        row["first_diff"] = min(diffs) if diffs else ""
        if row["system"] == NANOSERVE and row["part"] in BARS:
            row["bar"] = BARS[row["part"]]
            row["meets"] = "yes" if row["ratio"] >= row["bar"] else "no"
    for row in rows:  # every ratio known: nanoserve's ngram rows beside llama.cpp's
        peer = index.get(key(row, "ngram", LLAMA_CPP)[:4] + ("file", "ngram"))
        if row["system"] != NANOSERVE or row["method"] != "ngram" or "error" in row or peer is None:
            continue
        if rows[peer].get("tok_s"):
            row["vs_llama"] = row["tok_s"] / rows[peer]["tok_s"]
        if "ratio" in rows[peer]:
            row["llama_ratio"] = rows[peer]["ratio"]


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def write_plot(rows: Sequence[dict], path: Path) -> None:
    """Every speculating row's ratio over its no-speculation arm, with the bars."""
    shown = [r for r in rows if r.get("ratio") not in (None, "")]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(shown) + 2), 4.5))
    labels = [f"{r['part']}: {r['workload']} b{r['batch']}\n{r['system']} {r['weights']} {r['method']}" for r in shown]
    bars = ax.bar(range(len(shown)), [r["ratio"] for r in shown],
                  color=["tab:blue" if r["system"] == NANOSERVE else "tab:orange" for r in shown])
    ax.bar_label(bars, fmt="%.2f", fontsize="x-small")
    for part, bar in BARS.items():
        ax.axhline(bar, linestyle="--", color="grey", linewidth=0.8)
        ax.text(0.99, bar, f"{part} bar {bar}x", transform=ax.get_yaxis_transform(), fontsize="x-small",
                ha="right", va="bottom", color="grey")
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(shown)), labels, fontsize="x-small", rotation=30, ha="right")
    ax.set(ylabel="decode tok/s over no speculation", title="speculative decoding: speed-up over the same arm without")
    save_figure(fig, path)


# --- the suite -----------------------------------------------------------------------------------

@functools.cache
def _tokenizer(model: str):
    from nanoserve.model.formats.loader import load_tokenizer

    return load_tokenizer(model)


def build_jobs(arm: Arm, model: str, chars: int | None) -> list[dict]:
    """The arm's jobs with their prompts as token ids (every system gets the same ids)."""
    from nanoserve.model.formats.loader import load_config

    jobs = []
    for workload, batch in arm.jobs:
        if workload == "headline":
            prompts = make_prompts(batch, HEADLINE_PROMPT_LEN, load_config(model).vocab_size)
        else:
            prompts = [chat_prompt(_tokenizer(model), workload, chars)] * batch
        jobs.append(dict(workload=workload, batch=batch, prompts=prompts))
    return jobs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilebench.py spec", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a .gguf file, a Hugging Face directory, or smollm2 (the default); llama.cpp needs a GGUF")
    parser.add_argument("--rows", type=name_list(PARTS), default=PARTS, help="comma-separated parts: ngram,draft,batch")
    parser.add_argument("--new-tokens", type=int, default=256, help="greedy tokens per row, EOS ignored")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (llama.cpp: num_pred_tokens)")
    parser.add_argument("--batches", type=int_list, default=(8, 32), help="the batch part's batches")
    parser.add_argument("--batch-new-tokens", type=int, default=HEADLINE_NEW_TOKENS,
                        help="greedy tokens per row in the batch part (default: the headline's)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per job after its warm-up run")
    parser.add_argument("--mode", choices=("compile", "eager"), default="compile")
    parser.add_argument("--skip-llama-cpp", action="store_true", help="no llama.cpp arms")
    parser.add_argument("--text-chars", type=int, default=None,
                        help="cut each copying workload's text to this many characters (quick checks)")
    parser.add_argument("--spec-options", type=json.loads, default={},
                        help='JSON merged into every speculative config, e.g. \'{"adaptive": false}\'')
    parser.add_argument("--draft-options", type=json.loads, default={},
                        help='JSON merged into the draft config, e.g. \'{"model": "path.gguf"}\'')
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    add_output_options(parser)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker)

    host = host_description()
    print(f"CPU: {host['cpu']}; nanoserve kernels: {host['kernels']}, compute dtype {host['dtype']}; "
          f"torch threads {torch.get_num_threads()}")
    gguf = None
    if not args.skip_llama_cpp and "ngram" in args.rows:
        if not llama_peer.available():
            print(llama_peer.ABSENT)
        else:
            gguf = llama_peer.gguf_of(args.model)
    print(f"spec: parts {','.join(args.rows)}, k={args.k}, {args.new_tokens} greedy tokens per row "
          f"({args.batch_new_tokens} in the batch part), "
          f"{args.repeats} timed runs after a warm-up run, nanoserve {args.mode}")
    rows, tokens = [], {}
    for arm in plan_arms(args.rows, args.batches, gguf is not None):
        jobs = build_jobs(arm, args.model, args.text_chars)
        new_tokens = args.batch_new_tokens if arm.part == "batch" else args.new_tokens
        spec = dict(system=arm.system, model=args.model, gguf=str(gguf) if gguf else None, weights=arm.weights,
                    method=arm.method, k=args.k, new_tokens=new_tokens, repeats=args.repeats,
                    compile=args.mode == "compile", jobs=jobs,
                    speculative=speculative_config(arm.method, args.k, args.spec_options, args.draft_options))
        started = time.perf_counter()
        for job, measured in zip(jobs, run_alone(spec)):
            tokens[len(rows)] = measured.pop("tokens", [])
            rows.append({**host, "part": arm.part, "workload": job["workload"], "batch": job["batch"],
                         "system": arm.system, "weights": arm.weights, "method": arm.method, "k": args.k,
                         "prompt_tokens": len(job["prompts"][0]), "new_tokens": new_tokens, **measured})
            print(format_table(rows[-1:], [c for c in COLUMNS if c in rows[-1]]))
        print(f"  ({arm.part}: {arm.system} {arm.weights} {arm.method}: {time.perf_counter() - started:.0f} s)",
              flush=True)
    compare(rows, tokens)
    print("\n" + format_table(rows, [c for c in COLUMNS if any(c in r for r in rows)]))
    write_results(rows, args.out, result_stem("spec", args.model, args.tag), None if args.no_plot else write_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
