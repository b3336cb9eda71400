"""``check``: the rules' schema, running the gate, evaluating the rules, and CI outputs (JUnit, GitHub)."""
