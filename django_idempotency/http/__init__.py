"""What takes a Django request or makes a response, between the front doors and the engine."""
