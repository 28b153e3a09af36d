"""How faithful a weight format is to the fp32 reference, teacher-forced over a fixed text.

Both models read the same token ids; at every position each gives a distribution over the
next token. ``fidelity_metrics`` compares the two: how often their top choice agrees, the KL
divergence of the test distribution from the reference one, and each one's perplexity on the
text. A quantised format is judged by these figures against fp32, never by a looser tolerance
on the fp32 tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.model.network.llama import dense_forward
from nanoserve.model.network.reference_attention import ChunkedCausalAttention


@dataclass(frozen=True)
class FidelityMetrics:
    """Test against reference over ``tokens`` predicted positions (KL in nats per token)."""

    tokens: int
    top1_agreement: float
    mean_kl: float
    p99_kl: float
    ref_perplexity: float
    test_perplexity: float

    @property
    def perplexity_ratio(self) -> float:
        return self.test_perplexity / self.ref_perplexity


@torch.inference_mode()
def teacher_forced_logits(model, token_ids: list[int] | torch.Tensor, chunk_rows: int | None = None,
                          stored=None) -> torch.Tensor:
    """fp32 logits [T, vocab] of ``model`` at every position of ``token_ids`` (position t
    predicts token t + 1). ``chunk_rows=None`` is one dense forward; a number feeds the text
    in chunks of that many tokens, so packed layers run at that row count. ``stored`` (k, v)
    -> (k, v) is what a K/V cache keeps of them (its format's rounding: KVLayers.as_stored);
    the text is then read in chunks (of ``chunk_rows``, else all of it at once)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    if chunk_rows is None and stored is None:
        return dense_forward(model, ids[None])[0].float()
    chunk_rows = chunk_rows or ids.numel()
    attention, out = ChunkedCausalAttention(model.config.num_layers, stored), []
    for start in range(0, ids.numel(), chunk_rows):
        chunk = ids[start:start + chunk_rows]
        positions = torch.arange(start, start + chunk.numel())
        out.append(model.compute_logits(model(chunk, positions, attention)).float())
    return torch.cat(out)


def fidelity_metrics(ref_logits: torch.Tensor, test_logits: torch.Tensor, target_ids: torch.Tensor) -> FidelityMetrics:
    """Compare logits [T, vocab] (row t predicts ``target_ids[t]``) of a test model against a
    reference. KL(reference || test) per position; perplexities over ``target_ids``."""
    if ref_logits.shape != test_logits.shape or ref_logits.shape[0] != len(target_ids):
        raise ValueError(f"logits {tuple(ref_logits.shape)} / {tuple(test_logits.shape)} "
                         f"and {len(target_ids)} targets do not line up")
    targets = torch.as_tensor(target_ids, dtype=torch.long)
    kl, ref_nll, test_nll = (torch.cat(parts) for parts in zip(*(
        _position_terms(ref_logits[i:i + 256], test_logits[i:i + 256], targets[i:i + 256])
        for i in range(0, len(targets), 256))))
    return FidelityMetrics(
        tokens=len(targets),
        top1_agreement=(ref_logits.argmax(-1) == test_logits.argmax(-1)).double().mean().item(),
        mean_kl=kl.mean().item(),
        p99_kl=torch.quantile(kl, 0.99).item(),
        ref_perplexity=ref_nll.mean().exp().item(),
        test_perplexity=test_nll.mean().exp().item(),
    )


def _position_terms(ref: torch.Tensor, test: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # In float64 and a few hundred rows at a time: a KL of 1e-3 is a small difference of large sums.
    ref_logp, test_logp = torch.log_softmax(ref.double(), -1), torch.log_softmax(test.double(), -1)
    kl = (ref_logp.exp() * (ref_logp - test_logp)).sum(-1)
    return kl, -ref_logp.gather(1, targets[:, None])[:, 0], -test_logp.gather(1, targets[:, None])[:, 0]
