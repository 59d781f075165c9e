"""Images in prompts: where their tokens sit and the vision features the runner splices in."""
