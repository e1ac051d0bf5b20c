"""Where a finding is: the user's own ``file:line`` and source line, skipping frames of torch, of installed
packages and of lightning_sgdtp itself; and the ``compile_error`` finding that every check that runs the step
reports the same way."""

from __future__ import annotations

import linecache
import os
import re
import traceback
from pathlib import Path

import torch

from lightning_sgdtp.diagnose.report import Finding

_OWN_FILES = (str(Path(__file__).resolve().parents[1]),)  # lightning_sgdtp/
_USER_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def is_library_file(filename: str) -> bool:
    torch_dir = os.path.dirname(torch.__file__)
    return filename.startswith((torch_dir, *_OWN_FILES, "<")) or "site-packages" in filename


def source_line(filename: str, lineno: int) -> str | None:
    return linecache.getline(filename, lineno).strip() or None


def user_frame_from_text(text: str) -> tuple[str | None, str | None]:
    """``(file:line, source line)`` of the innermost user frame quoted in an error message."""
    frames = [(f, int(n)) for f, n in _USER_FRAME.findall(text) if not is_library_file(f)]
    if not frames:
        return None, None
    filename, lineno = frames[-1]
    return f"{filename}:{lineno}", source_line(filename, lineno)


def user_frame_from_traceback(exc: BaseException) -> tuple[str | None, str | None]:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not is_library_file(f.filename)]
    if frames:
        return f"{frames[-1].filename}:{frames[-1].lineno}", (frames[-1].line or "").strip() or None
    return user_frame_from_text(str(exc))


def headline(reason: str) -> str:
    return next((line.strip() for line in reason.splitlines() if line.strip()), reason)


def hints(reason: str) -> list[str]:
    return [
        line.strip().removeprefix("Hint:").strip() for line in reason.splitlines() if line.strip().startswith("Hint:")
    ]


def compile_error(exc: BaseException, doing: str) -> Finding:
    """The ``compile_error`` finding for ``exc``, raised while ``doing`` (e.g. "tracing the step")."""
    text = str(exc)
    where, source = user_frame_from_text(text) if "from user code" in text else user_frame_from_traceback(exc)
    explanation = next((ln.strip() for ln in text.splitlines() if ln.strip().startswith("Explanation:")), "")
    return Finding(
        "compile_error",
        "error",
        f"{type(exc).__name__} while {doing}: {headline(text) or type(exc).__name__}"
        + (f" ({explanation})" if explanation else ""),
        "fix this first: the step must run eagerly (torch.compiler.set_stance('force_eager') to check) and then"
        " compile; the message and the source line say where",
        where=where,
        source=source,
        details={"exception": type(exc).__name__, "message": text[:4000]},
    )
