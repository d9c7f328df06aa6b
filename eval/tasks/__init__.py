"""Long-horizon tasks: seeded, offline generators of prompts with gold answers."""
