"""(being written)"""


def register(router, ctx):
    pass
