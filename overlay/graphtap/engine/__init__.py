"""The engine side (vLLM's worker): the hook manager, the token router, one file per hook
family, and the engine's tables. It imports the spec's entries, the ops and the courier;
nothing imports it back but vLLM, through the entry point."""
