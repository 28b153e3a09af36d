"""The engine's options: one dataclass, each field with its default and its help. ``build_engine``
takes them as keywords, the command line's flags (options.py) and the README's table
(``options_table``) are made from them, and ``Engine.config`` is the record as it was asked
(what it resolved to is ``Engine.resolved``, nanoserve.engine.resolved).

Imports nothing heavy: the command line reads these before torch is loaded.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nanoserve.speculative.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

    from nanoserve.model.quant.weight_plan import WeightPlan


def option(default: Any, help: str, cli: bool = True, flag: str | None = None, choices: tuple | None = None,
           kind: str = "str") -> Any:
    """A field with its help text; ``cli`` says whether the command line offers it (``flag``:
    another spelling than --name-with-dashes; a True default is offered as its --no- flag), and
    ``kind`` how it reads its value there ("str", "int", or "bytes": 512M, 2G)."""
    return field(default=default, metadata=dict(help=help, cli=cli, flag=flag, choices=choices, kind=kind))


KV_CACHE_TYPES = ("auto", "bf16", "fp32", "q8_0")


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int | None = option(
        None, "longest prompt + reply, in tokens (default: the model's context length, lowered to what the "
              "K/V pool holds)", kind="int")
    max_batch_size: int = option(32, "rows: requests decoded together in one step", kind="int")
    kv_cache_bytes: int | None = option(
        None, "K/V pool budget, e.g. 512M, 2G (default: what max_batch_size rows of max_model_len need, at most 16,384 tokens' worth)",
        kind="bytes")
    kv_cache_dtype: str = option(
        "auto", "how K and V are stored: auto (the compute dtype), bf16, fp32, or q8_0 (llama.cpp's q8_0: int8 "
                "codes and an fp16 step per 32 values, ~1.9x bf16's tokens in the same bytes; head_dim a multiple "
                "of 32)", choices=KV_CACHE_TYPES)
    cache_type_k: str | None = option(
        None, "K's storage alone, as llama.cpp's --cache-type-k (default: kv_cache_dtype)", choices=KV_CACHE_TYPES)
    cache_type_v: str | None = option(
        None, "V's storage alone, as llama.cpp's --cache-type-v (default: kv_cache_dtype)", choices=KV_CACHE_TYPES)
    swa_full: bool = option(
        False, "sliding-window layers keep every position's K/V in the pool, as llama.cpp's --swa-full (default: "
               "each row keeps only their window, in a ring of its own; with prefix caching, a row's rings are "
               "also saved at its prompt's end and its release, for a later row adopting that prefix)")
    ring_snapshots: int | None = option(
        None, "with prefix caching and sliding-window rings: how many rows of rings are kept saved, each the "
              "window layers' K/V where a sequence stood at a block boundary, which a row adopting that prefix "
              "restores (as llama.cpp's --ctx-checkpoints; default: two per row; 0: none, so a cached prefix "
              "is computed again)", kind="int")
    block_size: int = option(16, "tokens per K/V block, the pool's unit of allocation", kind="int")
    max_num_batched_tokens: int | None = option(
        None, "a step's token budget (decode rows + prefill chunks), binding every step; default on the CPU: "
              "max batch size + max(48, half of it), 512 with no row decoding; on a GPU: 512; without "
              "chunked prefill: max(2048, max_model_len)", kind="int")
    prefill_only_budget: int | None = option(
        None, "tokens a step with no row decoding may prefill (default: 512 where max_num_batched_tokens "
              "is left to its default, else max_num_batched_tokens)", cli=False)
    dtype: str | torch.dtype | None = option(
        None, "activations and K/V: float32, float16, bfloat16 or a torch.dtype; given without --weights, the "
              "weights load dense in it (default: the weight format's; on the CPU auto, int8 and int4 compute in "
              "bfloat16 where the CPU has native bf16 (AVX-512 BF16, AMX, ARM BF16), else float32; bfloat16 on "
              "cuda; the startup summary names it)",
        choices=("float32", "float16", "bfloat16"))
    weights: str | WeightPlan | None = option(
        None, "weight format: auto, auto+dense (with a dense copy for steps of many rows), fp32, bf16, int8, int4, "
              "a plan name or a WeightPlan (default: auto, or dense in dtype when that is given). auto's int4 "
              "kernels round activations to 8 bits from 16 rows of a step (avx2 and avx-vnni: from 1; each weight code multiplied once: "
              "faster large batches, logits about as close to fp32 as llama.cpp's) and to 16 below; +a8 after "
              "auto or int4: 8 bits at every row count; auto+a16: 16 bits at every row count, so a row's logits "
              "do not depend on its batch",
        choices=("auto", "auto+dense", "auto+a8", "auto+a16", "auto+dense+a8", "fp32", "bf16", "int8", "int4", "int4+a8"))
    device: str = option("cpu", "torch device, e.g. cpu or cuda")
    compile: bool | None = option(
        None, "torch.compile the decode step: one graph per [rows, width] bucket, built once per machine into "
              "the compile cache ($NANOSERVE_CACHE_DIR, default ~/.cache/nanoserve/compile) and loaded from it; "
              "a bucket without a graph yet runs eagerly while its graph builds in the background (default: on; "
              "NANOSERVE_COMPILE=0 in the environment makes eager the default; --no-compile: eager)", kind="switch")
    compile_mode: str | None = option("reduce-overhead", "torch.compile mode of the decode step", cli=False)
    compile_backend: str = option("inductor", "torch.compile backend of the decode step", cli=False)
    compile_cpp_wrapper: bool = option(
        True, "on a CPU, the decode graphs call their kernels from generated C++ (inductor's cpp_wrapper), not "
              "Python: ~2 ms less a 1B step; a graph takes 1.5-2x as long to build", cli=False)
    bucketing: bool | None = option(None, "pad decode steps to [rows, width] buckets (default: with compile)",
                                    cli=False)
    row_buckets: tuple[int, ...] | None = option(None, "decode row buckets (default: 1, 2, 4, 8, then steps of "
                                                       "8 and 16 to max_batch_size)", cli=False)
    width_buckets: tuple[int, ...] | None = option(None, "decode width buckets (default: doubling block "
                                                         "multiples to max_model_len)", cli=False)
    warmup: str = option("lazy", "with compile: build the graphs the compile cache lacks before serving (eager), in "
                                 "the background while those buckets run eagerly (lazy), or not at all (none: "
                                 "only cached graphs run)", choices=("lazy", "eager", "none"))
    enable_chunked_prefill: bool = option(
        True, "turns chunked prefill off: each prompt is prefilled whole, in steps of its own, while running "
              "streams wait (default: on, long prompts are prefilled in chunks beside the decode rows)",
        flag="--no-chunked-prefill")
    enable_prefix_caching: bool = option(
        True, "turns prefix caching off: every prompt is computed from its first token (default: on, a prompt "
              "reuses the cached K/V of a prefix already seen)", flag="--no-prefix-caching")
    huge_pages: bool = option(
        True, "turns huge pages off: the weights and the K/V pool stay where torch allocates them, on the "
              "host's default pages (default: on, the CPU weights move to, and the K/V pool is made in, memory "
              "advised for transparent huge pages, which a decode step streams faster)", flag="--no-huge-pages")
    threads: int | None = option(
        None, "CPU threads for torch's ops and nanoserve's CPU kernels (torch.set_num_threads, process-wide; "
              "default: torch's, one per core)", kind="int")
    chat_template: str | None = option(
        None, "chat template in place of the model's own: a jinja file, or a built-in: chatml, gemma, llama3, "
              "mistral; checked on a sample conversation before the weights load (default: the model's own)")
    speculative: Any = option(
        None, "speculative decoding, as vLLM's config: a dict or JSON, e.g. '{\"method\": \"ngram\", "
              "\"num_speculative_tokens\": 4}' or '{\"method\": \"draft\", \"model\": PATH}' "
              "(default: none)", flag="--speculative-config", kind="json")
    tensor_parallel_size: int = option(
        1, "ranks the model is sharded over (tensor parallelism); on one host the engine starts the other "
           "ranks' processes itself, under torchrun it joins the launched ranks", kind="int")
    tensor_parallel_timeout: float = option(
        180.0, "seconds a tensor-parallel collective may wait for a rank before the engine fails (a rank "
               "compiling a new decode graph must finish within it)", cli=False)

    def __post_init__(self) -> None:
        if self.warmup not in ("eager", "lazy", "none"):
            raise ValueError(f"warmup must be 'eager', 'lazy' or 'none', got {self.warmup!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"threads must be an integer >= 1, got {self.threads!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        for name in ("kv_cache_dtype", "cache_type_k", "cache_type_v"):
            value = getattr(self, name)
            if value is not None and value not in KV_CACHE_TYPES:
                raise ValueError(f"{name} must be one of {', '.join(KV_CACHE_TYPES)}, got {value!r}")
        object.__setattr__(self, "speculative", SpeculativeConfig.of(self.speculative))
        if self.chat_template is not None:  # refused here, in one line, before any weights load
            from nanoserve.model.formats.chat_templates import checked_chat_template

            checked_chat_template(self.chat_template)


def kv_cache_types(config: EngineConfig) -> tuple[str, str]:
    """K's and V's storage as asked: each side's own setting, else kv_cache_dtype."""
    return config.cache_type_k or config.kv_cache_dtype, config.cache_type_v or config.kv_cache_dtype


def default_compile() -> bool:
    """Whether an engine compiles when ``compile`` is unset: yes, unless NANOSERVE_COMPILE=0."""
    return os.environ.get("NANOSERVE_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


def options() -> list[dataclasses.Field]:
    return list(dataclasses.fields(EngineConfig))


def cli_flag(option: dataclasses.Field) -> str:
    return option.metadata["flag"] or "--" + option.name.replace("_", "-")


def options_table() -> str:
    """The options as a markdown table (the README's), from the dataclass itself."""
    rows = ["| option | flag | default | what it sets |", "| --- | --- | --- | --- |"]
    for option in options():
        flag = f"`{cli_flag(option)}`" if option.metadata["cli"] else ""
        help = option.metadata["help"].replace("|", "\\|")
        rows.append(f"| `{option.name}` | {flag} | `{option.default!r}` | {help} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(options_table())
