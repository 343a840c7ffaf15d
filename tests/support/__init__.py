"""What several test files share: case definitions, plain references, runs and fixtures'
helpers. Test files import from here, never from each other."""
