"""The tracer's error: what could not be traced, where, and what to do (a leaf module, so that
every tracer pass can raise it without importing ``trace``)."""

from __future__ import annotations

__all__ = ["TraceError"]


class TraceError(RuntimeError):
    """A model could not be traced. Attributes: op, module_path, source, hint, cause."""

    def __init__(self, message: str, *, op: str = "", module_path: str = "", source: str = "",
                 hint: str = "", cause: str = "") -> None:
        self.op, self.module_path, self.source, self.hint, self.cause = (
            op, module_path, source, hint, cause)
        parts = [message]
        if op:
            parts.append(f"  op: {op}")
        parts.append(f"  module: {module_path or '<root>'}")
        if source:
            parts.append(f"  source: {source}")
        if hint:
            parts.append(f"  hint: {hint}")
        if cause:
            parts.append(f"  cause: {cause}")
        super().__init__("\n".join(parts))
