"""Tensor parallel: the plan (which submodule gets which DTensor style, ``plan``), the styles, and the DTensor op
rules torch lacks (``dtensor_ops``)."""
