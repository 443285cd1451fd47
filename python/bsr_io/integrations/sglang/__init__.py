"""SGLang HiCache storage backend: bsr-io's store as HiCache's storage tier.

Loaded by SGLang's backend factory from its configuration (`--hicache-storage-backend
dynamic`); `bsr_io.integrations.sglang.backend.BsrHiCacheStorage` is the class. This
package's other modules import no SGLang (docs/sglang.md).
"""

MODULE_PATH = "bsr_io.integrations.sglang.backend"
CLASS_NAME = "BsrHiCacheStorage"
