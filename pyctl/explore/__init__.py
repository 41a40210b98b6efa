"""`gpufault explore`: fault-space exploration (issue 24).

Discover the distinct fault points a service's requests pass through
(library, function, caller site, stack signature), plan which error codes
to inject at each, run one short experiment per point and code with a
caller filter limited to that site, and report which ones the SLO
survives. Modules, one job each: discover, codes, plan, tomlout, inject,
outcome, store, report; public is the library face (`gpufault.explore`).
"""
