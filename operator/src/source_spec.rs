//! The API's `spec.source` as the source readers take it ([`SourceSpec`]). The Secret
//! references stay on this side: the operator reads the Secrets ([`crate::sync::credentials`])
//! and hands the readers their values.

use sealed_crds::{HuggingFaceRepoType, Source, SourceKind};
use sealed_sources::{BucketPrefix, HubRepo, HubRepoType, SourceError, SourceSpec};

/// The one source `source` sets; `InvalidSource` when it sets none or several (the API
/// server refuses such objects; this is for objects built in code).
pub fn source_spec(source: &Source) -> Result<SourceSpec, SourceError> {
    let kind = source
        .kind()
        .map_err(|e| SourceError::Invalid(e.to_string()))?;
    Ok(match kind {
        SourceKind::HuggingFace(hf) => SourceSpec::HuggingFace(HubRepo {
            repo: hf.repo.clone(),
            revision: hf.revision.clone(),
            repo_type: match hf.repo_type {
                HuggingFaceRepoType::Model => HubRepoType::Model,
                HuggingFaceRepoType::Dataset => HubRepoType::Dataset,
            },
            include: hf.include.clone(),
            exclude: hf.exclude.clone(),
            endpoint: hf.endpoint.clone(),
        }),
        SourceKind::ObjectStore(os) => SourceSpec::ObjectStore(BucketPrefix {
            url: os.url.clone(),
            endpoint: os.endpoint.clone(),
            region: os.region.clone(),
        }),
        SourceKind::Upload(_) => SourceSpec::Upload,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use sealed_crds::{HuggingFaceSource, ObjectStoreSource, SecretKeyRef, SecretRef};

    #[test]
    fn every_field_the_readers_use_is_carried_over() {
        let hf = Source::hugging_face(HuggingFaceSource {
            repo: "acme/llm".into(),
            revision: "v2".into(),
            repo_type: HuggingFaceRepoType::Dataset,
            include: vec!["*.json".into()],
            exclude: vec!["*.bin".into()],
            token_secret_ref: Some(SecretKeyRef {
                name: "hf".into(),
                key: "token".into(),
            }),
            endpoint: Some("https://hub.example.com".into()),
        });
        assert_eq!(
            source_spec(&hf).unwrap(),
            SourceSpec::HuggingFace(HubRepo {
                repo: "acme/llm".into(),
                revision: "v2".into(),
                repo_type: HubRepoType::Dataset,
                include: vec!["*.json".into()],
                exclude: vec!["*.bin".into()],
                endpoint: Some("https://hub.example.com".into()),
            })
        );
        let os = Source::object_store(ObjectStoreSource {
            url: "s3://models/llm".into(),
            endpoint: Some("https://minio.example.com".into()),
            region: Some("eu-west-1".into()),
            credentials_secret_ref: Some(SecretRef { name: "s3".into() }),
        });
        assert_eq!(
            source_spec(&os).unwrap(),
            SourceSpec::ObjectStore(BucketPrefix {
                url: "s3://models/llm".into(),
                endpoint: Some("https://minio.example.com".into()),
                region: Some("eu-west-1".into()),
            })
        );
        assert_eq!(source_spec(&Source::upload()).unwrap(), SourceSpec::Upload);
    }

    #[test]
    fn no_source_or_two_is_invalid() {
        let none = Source::default();
        assert_eq!(source_spec(&none).unwrap_err().reason(), "InvalidSource");
        let two = Source {
            upload: Some(Default::default()),
            ..Source::object_store(ObjectStoreSource {
                url: "s3://b/p".into(),
                endpoint: None,
                region: None,
                credentials_secret_ref: None,
            })
        };
        assert_eq!(source_spec(&two).unwrap_err().reason(), "InvalidSource");
    }
}
