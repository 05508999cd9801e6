package exactlyonce_test

import (
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// Key poisoning: tenants choose their own idempotency
// keys; tenant "mallory" sends "invoice-1" before tenant "acme" does. With
// a shared key space acme's message is acked as a duplicate and never
// processed; with KeyByTenant each tenant has its own, and a message
// without a (valid) tenant is refused before the database.
func TestKeyByTenantIsolatesTenants(t *testing.T) {
	t.Parallel()
	d := testenv.Drivers(t)[0]
	msg := func(uuid, tenant, idem string) *message.Message {
		m := message.NewMessage(uuid, nil)
		if tenant != "" {
			m.Metadata.Set("tenant", tenant)
		}
		m.Metadata.Set("Idempotency-Key", idem)
		return m
	}
	run := func(t *testing.T, key func(*message.Message) (string, error)) (processed []string, outcomes []exactlyonce.Outcome, errs []error) {
		tables := testenv.WithConn(testenv.Schema(t), d.DB)
		eo, err := exactlyonce.New(exactlyonce.Config{DB: tables, Consumer: "billing", Key: key, NackDelay: -1, Logger: testenv.Logger(t),
			OnEvent: func(e exactlyonce.Event) { outcomes = append(outcomes, e.Outcome) }})
		require.NoError(t, err)
		h := eo.Middleware(func(m *message.Message) ([]*message.Message, error) {
			processed = append(processed, m.UUID)
			return nil, nil
		})
		for _, m := range []*message.Message{
			msg("m1", "mallory", "invoice-1"),
			msg("m2", "acme", "invoice-1"),
			msg("m3", "acme", "invoice-1"), // acme's own redelivery
			msg("m4", "", "invoice-2"),     // no tenant
			msg("m5", "acme:evil", "x"),    // a tenant that would break the format
		} {
			_, err := h(m)
			errs = append(errs, err)
		}
		return processed, outcomes, errs
	}

	t.Run("shared key space is poisoned", func(t *testing.T) {
		t.Parallel()
		processed, outcomes, _ := run(t, exactlyonce.KeyFromMetadata("Idempotency-Key"))
		require.Equal(t, []string{"m1", "m4", "m5"}, processed, "acme's invoice-1 was never processed")
		require.Equal(t, exactlyonce.Duplicate, outcomes[1])
	})
	t.Run("KeyByTenant", func(t *testing.T) {
		t.Parallel()
		processed, outcomes, errs := run(t, exactlyonce.KeyByTenant("tenant", exactlyonce.KeyFromMetadata("Idempotency-Key")))
		require.Equal(t, []string{"m1", "m2"}, processed)
		require.Equal(t, []exactlyonce.Outcome{exactlyonce.Processed, exactlyonce.Processed, exactlyonce.Duplicate, exactlyonce.Nacked, exactlyonce.Nacked}, outcomes)
		require.True(t, errors.Is(errs[3], exactlyonce.ErrInvalidKey), "%v", errs[3])
		require.ErrorContains(t, errs[3], `metadata "tenant": no tenant`)
		require.True(t, errors.Is(errs[4], exactlyonce.ErrInvalidKey), "%v", errs[4])
		require.ErrorContains(t, errs[4], `contains ":"`)
	})
	t.Run("default inner key is the UUID; an empty inner key is refused", func(t *testing.T) {
		t.Parallel()
		k := exactlyonce.KeyByTenant("tenant", nil)
		got, err := k(msg("u1", "acme", ""))
		require.NoError(t, err)
		require.Equal(t, "acme:u1", got)
		_, err = exactlyonce.KeyByTenant("tenant", exactlyonce.KeyFromMetadata("Idempotency-Key"))(msg("u2", "acme", ""))
		require.ErrorContains(t, err, "the key within the tenant is empty")
	})
}
