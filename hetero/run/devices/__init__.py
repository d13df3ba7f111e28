"""Memory tiers and devices behind small interfaces: the AXDIMM (emulated backend; the interface mirrors the paper's
runtime API) and the NVMe store."""
