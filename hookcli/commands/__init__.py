"""What each command computes, on top of the engine's run loop (``engine.run``): stats, shapes, grads,
check, features, fmaps, diff, modules. Each entry holds the run lock; returns records; never renders,
never registers hooks."""
