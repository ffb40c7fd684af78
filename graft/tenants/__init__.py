"""Many tenants' LoRA adapters trained side by side on one frozen base (`policy.TenantPolicy`)."""
