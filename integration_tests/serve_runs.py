"""``transformers serve`` on the tiled kernels: its command line, run as a user runs it, with a
tiny model saved to a folder.

``python integration_tests/serve_runs.py save FOLDER``: writes a tiny Llama (test weights) and a
word-level tokenizer with a chat template to FOLDER.

``python integration_tests/serve_runs.py serve COUNT_FILE ARGS...``: ``transformers serve
ARGS...`` in this process, with every call into the packed-requests entry
(``varlen.varlen_attention_on_pages``, which ``varlen_attention`` calls too) and the batched
one (``op.tiled_attention`` through ``flash_interface``) appending a line to COUNT_FILE. transformers 5.25 runs the model in a
spawned process, which imports this file again as its main module: the counting wrappers are
put in place at import, so they count there too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

COUNT_FILE = "HF_TILED_SERVE_COUNT_FILE"


def _count_calls() -> None:
    """Wraps the two entries the Hub-kernel route calls (flash_interface.py) so that each call
    appends its name to the file named by the environment's COUNT_FILE."""
    path = os.environ.get(COUNT_FILE)
    if not path:
        return
    from hf_tiled_attention import flash_interface, varlen

    def counted(name, function):
        def wrapper(*args, **kwargs):
            with open(path, "a") as f:
                f.write(name + "\n")
            return function(*args, **kwargs)
        return wrapper

    varlen.varlen_attention_on_pages = counted("varlen", varlen.varlen_attention_on_pages)
    flash_interface.tiled_attention = counted("batched", flash_interface.tiled_attention)


def save(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from models import VOCAB, build

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    core = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>")
    # messages' contents back to back: the prompt's tokens are its words
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(folder)
    model = build("llama", "eager")
    model.generation_config.do_sample = False
    model.save_pretrained(folder)


def main(argv: list[str]) -> int:
    command, rest = argv[0], argv[1:]
    if command == "save":
        save(Path(rest[0]))
        return 0
    if command == "serve":
        os.environ[COUNT_FILE] = rest[0]
        _count_calls()
        from transformers.cli.transformers import main as transformers_main
        sys.argv = ["transformers", "serve", *rest[1:]]
        return transformers_main() or 0
    raise SystemExit(f"serve_runs.py: unknown command {command!r} (save, serve)")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main(sys.argv[1:]))
else:
    _count_calls()  # the model's process (spawned: this file is imported as __mp_main__)
