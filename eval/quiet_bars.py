"""Imported by the eval scripts that load a model, before anything imports tqdm (torch does):
when stderr is not a terminal (a log, run_all.sh's console captured), no tqdm bar draws its
carriage-return frames there. transformers' GGUF loader ("Converting and de-quantizing GGUF
tensors") and weight loader ("Loading weights") draw bars the scripts cannot switch off per
call, and tqdm reads TQDM_DISABLE once, when it is first imported."""

import os
import sys

if not sys.stderr.isatty():
    os.environ.setdefault("TQDM_DISABLE", "1")
