"""How a value travels: the forms refshare stores, and the code that rebuilds them on a worker.

Each stored form is rebuilt on the worker into exactly what Ray's own unpickling would give
it, by functions of :mod:`refshare._wire.bootstrap`, which Ray ships by value: workers need
no refshare.
"""
