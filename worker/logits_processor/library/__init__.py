"""Reference processors users ask for, batch-level and enabled per request through ``extra_args``.

Each is registered under the ``logitpool.logits_processors`` entry-point group (pyproject.toml),
so a worker loads them like any installed plugin. Argmax invariance (where the sampler runs it):

=======================  ==================================================  =========
processor                extra_args                                          invariant
=======================  ==================================================  =========
DRYLogitsProcessor       dry_multiplier, dry_base, dry_allowed_length,       no  (5)
                         dry_penalty_last_n, dry_sequence_breakers
XTCLogitsProcessor       xtc_probability, xtc_threshold                      no  (5)
TypicalPLogitsProcessor  typical_p                                           no  (5)
NoRepeatNgram...         no_repeat_ngram_size                                no  (5)
TopALogitsProcessor      top_a                                               yes (7b)
EpsilonLogitsProcessor   epsilon_cutoff                                      yes (7b)
EtaLogitsProcessor       eta_cutoff                                          yes (7b)
MirostatLogitsProcessor  mirostat (= 2), mirostat_tau, mirostat_eta          yes (7b)
=======================  ==================================================  =========
"""

from __future__ import annotations

from worker.logits_processor.library.dry import DRYLogitsProcessor
from worker.logits_processor.library.epsilon import EpsilonLogitsProcessor
from worker.logits_processor.library.eta import EtaLogitsProcessor
from worker.logits_processor.library.mirostat import MirostatLogitsProcessor
from worker.logits_processor.library.no_repeat_ngram import NoRepeatNgramLogitsProcessor
from worker.logits_processor.library.top_a import TopALogitsProcessor
from worker.logits_processor.library.typical_p import TypicalPLogitsProcessor
from worker.logits_processor.library.xtc import XTCLogitsProcessor

LIBRARY_PROCESSORS = (
    DRYLogitsProcessor,
    EpsilonLogitsProcessor,
    EtaLogitsProcessor,
    MirostatLogitsProcessor,
    NoRepeatNgramLogitsProcessor,
    TopALogitsProcessor,
    TypicalPLogitsProcessor,
    XTCLogitsProcessor,
)

__all__ = [c.__name__ for c in LIBRARY_PROCESSORS] + ["LIBRARY_PROCESSORS"]
