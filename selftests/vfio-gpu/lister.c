// SPDX-License-Identifier: GPL-2.0-only
/*
 * Lists the cases of one VFIO selftest without running its main(): the
 * tests' main() opens the device before the harness parses -l, so on a host
 * (or a kernel without IOMMUFD) their own listing never runs.  Built once per
 * test on the build host, with TEST_SOURCE the test's .c file; prints one
 * "fixture<TAB>variant<TAB>test<TAB>timeout" line per case, in run order.
 */
#define main vfio_cxl_selftest_main
#include TEST_SOURCE
#undef main

int main(void)
{
	struct __fixture_variant_metadata no_variant = { .name = "", };
	struct __fixture_variant_metadata *v;
	struct __fixture_metadata *f;
	struct __test_metadata *t;

	for (f = __fixture_list; f; f = f->next)
		for (v = f->variant ?: &no_variant; v; v = v->next)
			for (t = f->tests; t; t = t->next)
				printf("%s\t%s\t%s\t%d\n", f->name, v->name, t->name, t->timeout);
	return 0;
}
