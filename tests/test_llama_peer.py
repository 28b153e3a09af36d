"""llama.cpp's arm on the default GGUF: rows, positions and logits line up with ours. Runs only
where llama-cpp-python is installed (`pip install -e '.[peers]'`)."""

from __future__ import annotations

import pytest
import torch

from compile.llama_peer import LlamaCpp, LlamaCppSteps, RepackMode, repack_mode, teacher_forced_logits
from nanoserve.model.network.llama import dense_forward

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[peers]')")
pytestmark = [pytest.mark.slow, pytest.mark.model]

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    return", "Once upon a time, a small robot"]


@pytest.fixture(scope="module")
def peer(smollm2_path):
    # Unrepacked, which runs on every host (repacked weights crash llama_decode on some).
    peer = LlamaCpp(smollm2_path, max_rows=len(PROMPTS), max_len=64, threads=2, max_batch_tokens=16, repack=False)
    yield peer
    peer.close()


def test_teacher_forced_logits_predict_the_next_token_as_fp32_does(peer, smollm2):
    model, tokenizer = smollm2
    ids = tokenizer.encode(" ".join(PROMPTS))  # longer than one 16-token batch: chunks join up
    theirs = torch.from_numpy(teacher_forced_logits(peer, ids))
    ours = dense_forward(model, torch.tensor([ids]))[0]
    assert theirs.shape == ours.shape == (len(ids), model.config.vocab_size)
    # llama.cpp rounds activations to 8 bits, so not equal; a shifted position would agree ~never.
    agreement = (theirs.argmax(-1) == ours.argmax(-1)).float().mean().item()
    assert agreement >= 0.8


def test_batched_steps_decode_every_row_to_the_same_length(peer, smollm2):
    _, tokenizer = smollm2
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    steps = LlamaCppSteps(peer, prompts, 6)
    while not steps.done:
        steps.step()
    assert len(steps.decode_steps) == 5 and all(t > 0 for t in steps.decode_steps)
    assert [len(t) for t in steps.tokens] == [6, 6, 6]
    # Row 0 alone, teacher-forced over what the batch generated, predicts the batch's choices.
    ids = prompts[0] + steps.tokens[0]
    alone = teacher_forced_logits(peer, ids).argmax(-1)[len(prompts[0]) - 1:-1].tolist()
    assert sum(a == b for a, b in zip(alone, steps.tokens[0])) >= 5


def test_sampled_steps_draw_by_llama_cpps_own_chain_and_free_it(peer, smollm2):
    _, tokenizer = smollm2
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    steps = LlamaCppSteps(peer, prompts, 6, dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05))
    assert steps.chain is not None
    while not steps.done:
        steps.step()
    assert [len(t) for t in steps.tokens] == [6, 6, 6]
    assert all(0 <= t < peer.vocab_size for row in steps.tokens for t in row)
    assert steps.chain is None  # freed once the run is done


def test_llama_cpp_runs_as_its_users_do_or_says_why_not(smollm2_path):
    mode = repack_mode(smollm2_path, "auto", threads=2)
    if mode.repack:
        assert mode.label == "defaults (repacking on)"
    else:  # its default died in a child process; this one lives on to say how
        assert mode.label.startswith("repacking off: its default crashes here (")
    assert repack_mode(smollm2_path, "off", threads=2) == RepackMode(False, "repacking off (asked)")


def test_e2e_compares_with_llama_cpps_defaults_and_unrepacked_beside_them(smollm2_path):
    from compile.common import DecodeWorkload
    from compile.e2e import run

    work = DecodeWorkload(model=str(smollm2_path), weights=("auto",), modes=("eager",), batches=(1,),
                          prompt_len=6, new_tokens=3, transformers=False, llama_repack="both")
    [row] = run(work)
    mode = repack_mode(smollm2_path, "auto", threads=work.threads)
    assert row["llama_cpp"] == mode.label and row["llama_tok_s"] > 0
    # the unrepacked arm runs beside repacked defaults; where those crash it is the only arm
    assert ("llama_norepack_tok_s" in row) == mode.repack
