"""The engine: load a model, build its inputs, select modules, run it with hooks (``session`` records a
run, ``hooks`` attaches the hooks: the only modules that register hooks), reduce tensors to statistics,
and hand the model back as it came."""
