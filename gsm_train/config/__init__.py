"""The recipe and GSM config schema (`GSMConfig`, `RecipeConfig`), YAML loading and the built-in recipes."""
