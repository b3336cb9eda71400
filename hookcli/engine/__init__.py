"""The engine: load a model, build its inputs, select modules, run it with hooks (``session``, the only
module that registers hooks), reduce tensors to statistics, and hand the model back as it came."""
