"""What each command computes, on top of the engine: grads, check, features, fmaps (shapes and stats are
one forward run of the engine). Returns records; never renders, never registers hooks."""
