"""The infill sampler stage (llama.cpp's `infill` sampler, which llama.vim and llama.vscode ask for with
samplers ["top_k", "top_p", "infill"]): its three outcomes, worked by hand from llama.cpp's
src/llama-sampler.cpp (llama_sampler_infill_apply)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from localllm.errors import LocalLLMError
from localllm.chat.sampling import Sampler, SamplingParams

EOS, EOT = 0, 1


class Vocab:
    """A stand-in vocabulary: token i's text is PIECES[i]; 0 and 1 end generation (control: no text)."""

    PIECES = [b"", b"", b"re", b"return", b"x", b" y", b"ret", b"z", b"a", b"b"]
    eog_ids = frozenset({EOS, EOT})
    eos_id, eot_id = EOS, EOT

    def piece_bytes(self, t: int, special: bool = True) -> bytes:
        return self.PIECES[t]


def infill_sampler(**kw) -> Sampler:
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, infill=True, seed=1, **kw)
    return Sampler(params, len(Vocab.PIECES), vocab=Vocab())


def logits_for(probs: dict[int, float]) -> np.ndarray:
    x = np.full(len(Vocab.PIECES), -np.inf, dtype=np.float32)
    for t, p in probs.items():
        x[t] = math.log(p)
    return x


def test_infill_keeps_only_the_end_when_the_model_leans_to_ending():
    # 3 candidates, p(end) = 0.2: 3 * 0.2 * 3 = 1.8 > p(text) 0.8, so only end-of-generation tokens are left.
    ids, probs = infill_sampler().distribution(logits_for({EOT: 0.2, 4: 0.5, 5: 0.3}))
    assert ids.tolist() == [EOT] and probs.tolist() == [1.0]


def test_infill_folds_prefixes_and_keeps_the_sure_tokens():
    # End 0.01: 3 * 0.01 * 6 candidates < 0.99 of text. "return" (0.30) takes "re" (0.25), then "ret" (0.05):
    # 0.60. Over 0.2 stay "return" and "x" (0.25), and the end token; renormalized over 0.86, "x" has 0.29,
    # under 1 / (2 + 1), so "return" and the end token are left, drawn by their own logits (0.30 : 0.01).
    x = logits_for({2: 0.25, 3: 0.30, 6: 0.05, 4: 0.25, 5: 0.14, EOT: 0.01})
    ids, probs = infill_sampler().distribution(x)
    got = dict(zip(ids.tolist(), probs.tolist()))
    assert sorted(got) == [EOT, 3]
    assert got[3] == pytest.approx(0.30 / 0.31) and got[EOT] == pytest.approx(0.01 / 0.31)


def test_infill_ends_the_text_when_no_token_is_sure():
    # Five text tokens at 0.198 that start none of each other, end 0.01 (3 * 0.01 * 6 < 0.99): none reaches
    # 0.2, so llama.cpp answers with the end-of-text token alone.
    x = logits_for({4: 0.198, 5: 0.198, 7: 0.198, 8: 0.198, 9: 0.198, EOS: 0.01})
    s = infill_sampler()
    assert s.distribution(x)[0].tolist() == [EOT]
    assert s.sample(x).id == EOT


def test_infill_after_top_k_only_sees_the_candidates_left():
    # With top-k 2, only "return" (0.30) and "x" (0.25) are candidates: renormalized, 0.545 and 0.455, both sure.
    x = logits_for({2: 0.2, 3: 0.30, 4: 0.25, 5: 0.14, EOT: 0.11})
    params = SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, infill=True, seed=1)
    ids, _ = Sampler(params, len(Vocab.PIECES), vocab=Vocab()).distribution(x)
    assert sorted(ids.tolist()) == [3, 4]


def test_infill_with_greedy_takes_the_best_token_it_left():
    x = logits_for({2: 0.25, 3: 0.30, 6: 0.05, 4: 0.25, 5: 0.14, EOT: 0.01})
    assert infill_sampler().sample(x).id in (EOT, 3)
    greedy = Sampler(SamplingParams(temperature=0, infill=True), len(Vocab.PIECES), vocab=Vocab())
    assert greedy.sample(x).id == 3


def test_infill_needs_the_vocabulary():
    with pytest.raises(LocalLLMError, match="vocabulary"):
        Sampler(SamplingParams(infill=True), 8)
