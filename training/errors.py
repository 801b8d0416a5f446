"""Exception tree of training.

TrainingError
 +-- DataError          the data set is unusable; the message names the column / class / count
 +-- ConfigError        settings contradict each other; the message names the field and the fix
 +-- CheckpointError    a checkpoint cannot be resumed from
 +-- ModelError         a model factory cannot be imported or built, or its output is wrong
"""


class TrainingError(Exception):
    pass


class DataError(TrainingError):
    pass


class ConfigError(TrainingError):
    pass


class CheckpointError(TrainingError):
    pass


class ModelError(TrainingError):
    pass
