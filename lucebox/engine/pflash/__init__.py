"""PFlash speculative prefill: a small scorer compresses a long prompt before the target prefills it.

The algorithm and its defaults: docs/spec/PFLASH.md. The pieces:

- config.py     PFlashConfig, every parameter;
- scorer.py     the scorer's forward and the per-token importance (tail attention over pre-RoPE q/k);
- sparse.py     the scorer's attention, dense or block-sparse (flex_attention BlockMask);
- selection.py  smoothing, chunks, head/tail/anchor chunks, fill by score;
- compress.py   PFlash: text -> scorer ids -> kept chunks -> target ids (re-tokenizing when tokenizers differ).

    pf = PFlash.for_model(target_loaded, scorer_loaded)   # scorer default: the target itself
    result = pf.compress(prompt_text, query=last_user_message)
    engine.add(result.ids, params)   # the target prefills the compressed prompt from position 0
"""

from lucebox.engine.pflash.compress import PFlash, PFlashResult, ScoredPrompt, same_tokenizer
from lucebox.engine.pflash.config import PFlashConfig
from lucebox.engine.pflash.scorer import token_importance
from lucebox.engine.pflash.selection import Selection, select_chunks

__all__ = ["PFlash", "PFlashConfig", "PFlashResult", "ScoredPrompt", "Selection", "same_tokenizer",
           "select_chunks", "token_importance"]
