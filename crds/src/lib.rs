//! The InferenceRoute API.
