"""The chat layer stands below the API layer: importing it loads no dialect module.

`lucebox/api/__init__.py` imports every dialect, and every dialect imports
`lucebox.chat.run`; a runtime import of `lucebox.api` from the chat layer would
let the import order decide whether the server starts (a partially initialised
module). Each check runs in a fresh interpreter, so nothing imported earlier in
the test session hides it.
"""

from __future__ import annotations

import subprocess
import sys


def loaded_after(code: str) -> list[str]:
    """Run `code` in a fresh interpreter; it prints module names, one line per checkpoint."""
    out = subprocess.run([sys.executable, "-c", "import sys\n" + code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()


SHOW = "print(' '.join(m for m in sys.modules if m.startswith(('lucebox', 'torch'))))"


def test_the_run_loads_no_api_module_and_the_api_imports_after_it():
    first, then = (set(line.split()) for line in loaded_after(f"import lucebox.chat.run\n{SHOW}\n"
                                                             f"import lucebox.api\n{SHOW}"))
    assert {"lucebox.chat.run", "lucebox.chat.request", "lucebox.chat.toolcalls"} <= first
    assert not {m for m in first if m.startswith("lucebox.api")}
    assert {"lucebox.api.anthropic", "lucebox.api.openai_chat", "lucebox.api.openai_responses"} <= then


def test_tool_call_parser_needs_neither_torch_nor_the_engine():
    (line,) = loaded_after(f"import lucebox.chat.toolcalls\n{SHOW}")
    assert not {m for m in line.split() if m == "torch" or m.startswith(("lucebox.engine", "lucebox.api"))}
