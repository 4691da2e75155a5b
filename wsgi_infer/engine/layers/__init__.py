"""Network building blocks shared by the model definitions."""
