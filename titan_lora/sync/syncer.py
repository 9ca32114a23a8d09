"""placeholder"""
def build_syncer(run):  # noqa
    raise NotImplementedError
class WeightSyncer: ...
