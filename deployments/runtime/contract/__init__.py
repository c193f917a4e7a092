"""What a model is and what a request must be: config, datatypes, errors, repository, validation, shapes."""
