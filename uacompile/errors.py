class IRError(ValueError):
    """Invalid IR: names the offending field and the rule it breaks."""

    def __init__(self, field: str, rule: str):
        self.field, self.rule = field, rule
        super().__init__(f"{field}: {rule}")

    def __reduce__(self):  # picklable with its two arguments: a spawned build worker can raise it
        return type(self), (self.field, self.rule)
