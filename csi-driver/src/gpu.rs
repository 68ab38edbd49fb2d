//! Which GPUs this plugin refuses to serve: the `nvidia.com/gpu.product` node label against
//! an exclusion list.
//!
//! Matching is exact and case-insensitive after dropping the `-SHARED` suffix that GPU feature
//! discovery adds under time-slicing. Not substring: `L4` must not exclude an `NVIDIA-L40S`.

/// The node label GPU feature discovery sets to the GPU model.
pub const GPU_PRODUCT_LABEL: &str = "nvidia.com/gpu.product";

/// The T4 and L4 variants as GPU feature discovery names them.
pub const DEFAULT_EXCLUDED: &str = "Tesla-T4,NVIDIA-T4,T4,NVIDIA-L4,L4";

#[derive(Clone, Debug, Default)]
pub struct GpuExclusion {
    products: Vec<String>,
}

impl GpuExclusion {
    /// From a comma-separated list; empty entries are ignored, so `""` excludes nothing.
    pub fn parse(list: &str) -> Self {
        let products = list
            .split(',')
            .map(|p| normalize(p.trim()))
            .filter(|p| !p.is_empty())
            .collect();
        GpuExclusion { products }
    }

    pub fn is_excluded(&self, product: &str) -> bool {
        let product = normalize(product.trim());
        self.products.contains(&product)
    }
}

fn normalize(product: &str) -> String {
    let lower = product.to_ascii_lowercase();
    lower
        .strip_suffix("-shared")
        .map(str::to_string)
        .unwrap_or(lower)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_list_excludes_t4_and_l4_only() {
        let x = GpuExclusion::parse(DEFAULT_EXCLUDED);
        for p in [
            "Tesla-T4",
            "NVIDIA-L4",
            "nvidia-l4",
            "NVIDIA-L4-SHARED",
            "T4",
        ] {
            assert!(x.is_excluded(p), "{p}");
        }
        for p in [
            "NVIDIA-L40S",
            "NVIDIA-A100-SXM4-80GB",
            "NVIDIA-H100-80GB-HBM3",
            "",
        ] {
            assert!(!x.is_excluded(p), "{p}");
        }
        assert!(!GpuExclusion::parse("").is_excluded("Tesla-T4"));
    }
}
