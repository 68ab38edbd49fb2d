//! CSI node plugin (not built yet).
