"""The keys under which the tracer stores its metadata in ``fx.Node.meta``.

A module of their own so that every tracer module (the graph record, the decomposition pass)
can import them without importing each other.
"""

__all__ = ["MODULE_KEY", "PLACEHOLDER_KEY", "DECOMPOSED_KEY", "PARAM_CAST_KEY", "export_module_path"]

MODULE_KEY = "autopar_module"  # the module path of the nn.Module that ran the op ("transformer.h.3.attn")
PLACEHOLDER_KEY = "autopar_placeholder"  # a placeholder's Placeholder record (kind, FQN)
DECOMPOSED_KEY = "autopar_decomposed_from"  # the op a node's decomposition came from
PARAM_CAST_KEY = "autopar_param_cast"  # on a mixed-precision weight cast: its parameter's placeholder name


def export_module_path(node) -> str:
    """The innermost module of ``torch.export``'s ``nn_module_stack`` on an fx node ("" for the
    root): what the tracer stores under ``MODULE_KEY``, and the fallback for raw export graphs."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else str(path)
