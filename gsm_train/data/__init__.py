"""Text and chat data: loading, packing, copy spans, streaming."""
