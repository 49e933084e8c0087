class IRError(ValueError):
    """Invalid IR: names the offending field and the rule it breaks."""

    def __init__(self, field: str, rule: str):
        self.field, self.rule = field, rule
        super().__init__(f"{field}: {rule}")
