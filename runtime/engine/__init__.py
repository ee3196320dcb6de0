"""What many requests share: the request/event contract, sequences, scheduling, the step loop."""
