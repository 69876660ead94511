"""Keys: what makes two values the same, exactly when Ray would send them the same way.

``identify`` keys a value: leaves (bytes, strings, arrays, tensors) are hashed in place
(``leaves``), an object hashed before is vouched for by a stamp (``stamps``), containers
and plain objects go through a pickling pass that hashes instead of storing (``pickler``),
and a value with pickling code of its own by the pickle Ray sends (``refshare._wire``).
"""

from .pickler import Identified as Identified
from .pickler import fingerprint as fingerprint
from .pickler import identify as identify
from .tables import Key as Key
from .tables import Keyed as Keyed
from .tables import Memo as Memo
