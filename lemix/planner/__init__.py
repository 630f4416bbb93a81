"""The planner: pure, synchronous placement of inference and training tasks on
nodes (`planner.Planner`), its policies (`policies/`) and the registry that
builds one by name (`registry`)."""
