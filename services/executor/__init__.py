"""The executor service: one process per GPU node, S stage workers."""
