"""The global scheduler service: an asyncio loop around the pure planner."""
